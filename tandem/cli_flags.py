"""vLLM compatibility of the `tandem` command line, and how it reports bad flags.

A vLLM launch line should run unchanged where its flags mean something here. This module holds
what does not carry over: the vLLM flags Tandem refuses, each with one line saying what to use
instead (`VLLM_REFUSED`); the vLLM switches it accepts and ignores because what they ask for
already holds (`VLLM_ACCEPTED`); `--model DIR`, vLLM's spelling of MODEL_DIR; the one-line answer
to an unknown flag, with the closest real flag; and the --help formatter that ends every entry
with its default. The flags themselves are defined in `tandem/cli.py`.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

_ONE_GPU = "Tandem runs a model on one GPU; drop the flag (`tandem plan MODEL_DIR` shows whether it fits)"
_LOCAL_DIR = ("Tandem loads a local directory and downloads nothing; download the checkpoint first (e.g. "
              "`huggingface-cli download REPO --revision REV --local-dir DIR`) and pass DIR")
_NO_LORA = "LoRA adapters are not supported; merge the adapter into the weights and serve the merged directory"
_TLS = "Tandem serves plain HTTP; terminate TLS in a reverse proxy (nginx, Caddy) in front of it"
_CORS = "Tandem sends no CORS headers; add them in a reverse proxy if browsers call the server directly"
_GRAPHS = "Tandem picks its CUDA graph shapes itself and compiles nothing else; --enforce-eager turns the graphs off"
_PARTIAL = "Tandem chunks prefills by --max-num-batched-tokens alone; drop the flag"
_TEXT_ONLY = "Tandem serves text-only models; drop the flag"
_ONE_SERVER = "Tandem serves on one GPU; run one server per GPU behind a load balancer"
_UNQUANTIZED = "Tandem serves unquantized checkpoints; choose their precision with --dtype"

# vLLM flags whose meaning does not hold here -> what to do instead (one line each).
VLLM_REFUSED: dict[str, str] = {
    "--tensor-parallel-size": _ONE_GPU,
    "-tp": _ONE_GPU,
    "--pipeline-parallel-size": _ONE_GPU,
    "-pp": _ONE_GPU,
    "--data-parallel-size": _ONE_SERVER,
    "-dp": _ONE_SERVER,
    "--enable-expert-parallel": "Tandem keeps every expert on its one GPU; drop the flag",
    "--distributed-executor-backend": "Tandem runs in one process on one GPU; drop the flag",
    "--quantization": _UNQUANTIZED,
    "-q": _UNQUANTIZED,
    "--cpu-offload-gb": "Tandem offloads whole layers' routed experts to RAM, computed on the CPU: use --cpu-moe, "
                        "--n-cpu-moe N or nothing (automatic when the model does not fit); `tandem plan MODEL_DIR` "
                        "shows the placement",
    "--swap-space": "preempted requests are recomputed, never swapped to CPU memory; drop the flag",
    "--preemption-mode": "preempted requests are always recomputed; drop the flag",
    "--num-gpu-blocks-override": "size the KV cache with --kv-cache-memory",
    "--tokenizer": "Tandem reads tokenizer.json from the model directory; put the tokenizer files there",
    "--tokenizer-mode": "Tandem always uses the fast tokenizer (tokenizer.json); drop the flag",
    "--revision": _LOCAL_DIR,
    "--tokenizer-revision": _LOCAL_DIR,
    "--code-revision": _LOCAL_DIR,
    "--download-dir": _LOCAL_DIR,
    "--load-format": "Tandem loads safetensors checkpoints only; drop the flag",
    "--hf-overrides": "edit the checkpoint's config.json instead",
    "--enable-lora": _NO_LORA,
    "--lora-modules": _NO_LORA,
    "--max-loras": _NO_LORA,
    "--max-lora-rank": _NO_LORA,
    "--compilation-config": _GRAPHS,
    "-O": _GRAPHS,
    "--max-seq-len-to-capture": _GRAPHS,
    "--max-num-partial-prefills": _PARTIAL,
    "--max-long-partial-prefills": _PARTIAL,
    "--long-prefill-token-threshold": _PARTIAL,
    "--scheduling-policy": "Tandem always schedules first come, first served; drop the flag",
    "--limit-mm-per-prompt": _TEXT_ONLY,
    "--mm-processor-kwargs": _TEXT_ONLY,
    "--enable-reasoning": "give --reasoning-parser NAME (qwen3) instead",
    "--enable-log-requests": "Tandem never logs request contents; drop the flag",
    "--disable-uvicorn-access-log": "use --uvicorn-log-level warning (uvicorn logs each request at info)",
    "--disable-fastapi-docs": "Tandem serves no /docs or /redoc pages (only /openapi.json); drop the flag",
    "--ssl-keyfile": _TLS,
    "--ssl-certfile": _TLS,
    "--ssl-ca-certs": _TLS,
    "--ssl-cert-reqs": _TLS,
    "--allowed-origins": _CORS,
    "--allowed-methods": _CORS,
    "--allowed-headers": _CORS,
    "--allow-credentials": _CORS,
    "--root-path": "serve behind a reverse proxy that strips the path prefix",
}

# vLLM switches that change nothing here -> what already holds (their --help text). `tandem serve`
# accepts them (`add_accepted_flags`) so that a vLLM launch line runs; `serve` may still act on
# one (it logs that --trust-remote-code changes nothing).
VLLM_ACCEPTED: dict[str, str] = {
    "--enable-prompt-tokens-details": "usage.prompt_tokens_details.cached_tokens is always reported",
    "--disable-log-requests": "Tandem never logs request contents",
    "--trust-remote-code": "Tandem never runs code from a checkpoint (it loads only the architectures it implements)",
}


def add_accepted_flags(parser: argparse.ArgumentParser) -> None:
    """Add every `VLLM_ACCEPTED` switch (store_true, default off) to `parser`, in one help group."""
    group = parser.add_argument_group("accepted for vLLM command lines, changing nothing (what they ask for holds)")
    for name, holds in VLLM_ACCEPTED.items():
        group.add_argument(name, action="store_true", help=holds)


def add_model_option(parser: argparse.ArgumentParser) -> None:
    """`--model DIR`, vLLM's spelling of the positional MODEL_DIR (`FlagParser` merges the two)."""
    parser.add_argument("--model", dest="model_option", default=None, metavar="DIR",
                        help="vLLM's spelling of MODEL_DIR; giving both with different values is an error "
                             "(default: MODEL_DIR)")


def refused_reason(flag: str) -> str | None:
    """Why the vLLM flag `flag` (its name, without `=value`) is refused; None if it is not one.
    Short flags match with their value attached too (`-O3`, `-tp2`)."""
    if flag in VLLM_REFUSED:
        return VLLM_REFUSED[flag]
    if not flag.startswith("--"):
        return next((why for name, why in VLLM_REFUSED.items() if not name.startswith("--") and flag.startswith(name)),
                    None)
    return None


def unrecognized_message(extras: Sequence[str], options: Sequence[str]) -> str:
    """One line for the arguments argparse could not place: a refused vLLM flag says what to use
    instead, another unknown flag gets the closest of `options`; flags are reported before stray
    positional words."""
    flags = [a for a in extras if a.startswith("-") and len(a) > 1]
    if not flags:
        return f"unexpected argument {extras[0]!r}: give at most one MODEL_DIR (flags start with --)"
    name = flags[0].split("=", 1)[0]
    why = refused_reason(name)
    if why is not None:
        return f"{name} is not supported: {why}"
    # Compared without their dashes, which every flag shares and which would make any two look alike.
    bare = {option.lstrip("-"): option for option in options}
    close = difflib.get_close_matches(name.lstrip("-"), bare, n=1, cutoff=0.6)
    hint = f"did you mean {bare[close[0]]}?" if close else "--help lists the flags"
    return f"unrecognized argument {name}; {hint}"


def option_strings(parser: argparse.ArgumentParser) -> list[str]:
    return [s for action in parser._actions for s in action.option_strings]  # argparse has no public list


class FlagParser(argparse.ArgumentParser):
    """Bad flags print one line (no usage dump) and exit 2: a refused vLLM flag with its advice, an
    unknown one with a did-you-mean. `commands` holds the subcommands' parsers, whose flags the
    did-you-mean is chosen from. `--model DIR` (`add_model_option`) lands in `model`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.commands: dict[str, argparse.ArgumentParser] = {}

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)

    def parse_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                   namespace: Any = None) -> argparse.Namespace:
        ns, extras = self.parse_known_args(args, namespace)
        command = self.commands.get(getattr(ns, "command", None) or "", self)
        if extras:
            command.error(unrecognized_message(extras, option_strings(command)))
        if hasattr(ns, "model_option"):
            given = vars(ns).pop("model_option")
            if given is not None and ns.model is not None and Path(given).resolve() != Path(ns.model).resolve():
                command.error(f"MODEL_DIR {ns.model!r} and --model {given!r} differ; give one of them")
            ns.model = ns.model if ns.model is not None else given
        return ns


def shown_default(value: object) -> str:
    """A default as `--help` and the README show it: booleans as on/off, None as none."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if value is None:
        return "none"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


class HelpFormatter(argparse.HelpFormatter):
    """Every entry ends with its default: `(default: X)` from the parser's default, unless the help
    text already states it (a default computed at start-up is described in words there)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        # BooleanOptionalAction appends its own on some Pythons.
        text = (action.help or "").replace(" (default: %(default)s)", "")
        if "(default" in text or action.default is argparse.SUPPRESS:
            return text
        return f"{text} (default: {shown_default(action.default).replace('%', '%%')})"
