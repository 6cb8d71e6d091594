"""The `tandem` command. `tandem serve [MODEL_DIR]` runs the OpenAI-compatible server.

Flag names follow vLLM's: a vLLM launch line runs unchanged where the flags mean something here,
and a vLLM flag that does not apply is refused with one line saying what to use instead (that
table, the accepted no-op switches and the reporting of bad flags are in `tandem/cli_flags.py`;
the flags and their configs are here, the server process in `tandem/server/launch.py`: the port
bound before the model loads, so /health answers 503 during the load and 200 once the engine
runs; SIGINT/SIGTERM stop accepting connections, let running requests finish for up to
--shutdown-timeout seconds, abort the rest and exit 0).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tandem.cli_flags import VLLM_REFUSED as VLLM_REFUSED  # re-exported: `from tandem.cli import VLLM_REFUSED`
from tandem.cli_flags import FlagParser, HelpFormatter, add_accepted_flags, add_model_option
from tandem.config import (
    BLOCK_SIZES,
    DEFAULT_BATCHED_TOKENS,
    MAX_AUTO_CHUNK,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    OffloadConfig,
    RunnerConfig,
    SchedulerConfig,
    ServerConfig,
    SpecConfig,
    parse_size,
    resolve_device,
    resolve_dtype,
)
from tandem.core import MAX_LOGPROBS, SEED_END, SEED_MIN
from tandem.kv.spec import KV_CACHE_DTYPES
from tandem.server.launch import bind_socket as bind_socket  # re-exported: `from tandem.cli import bind_socket`
from tandem.server.launch import serve_until_exit
from tandem.server.launch import uvicorn_config as uvicorn_config  # re-exported, as bind_socket

if TYPE_CHECKING:
    from tandem.offload.measure import MachineConstants

logger = logging.getLogger("tandem")

# The shipped models (tandem-demo, tandem-builtin) are Qwen3-style: <think> reasoning and Hermes
# <tool_call> blocks, so serving them turns both parsers on unless a flag says otherwise.
SHIPPED_REASONING_PARSER = "qwen3"
SHIPPED_TOOL_CALL_PARSER = "hermes"
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
UVICORN_LOG_LEVELS = ("trace", *LOG_LEVELS)


def _bool_flag(parser: argparse.ArgumentParser, name: str, default: bool | None, help: str) -> None:
    parser.add_argument(name, action=argparse.BooleanOptionalAction, default=default, help=help)


def _add_capacity_flags(p: argparse.ArgumentParser, batched_note: str = "") -> None:
    """--max-model-len, --max-num-seqs, --max-num-batched-tokens: `serve` and `plan` alike."""
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output, in tokens (default: the checkpoint's max_position_embeddings)")
    p.add_argument("--max-num-seqs", type=int, default=SchedulerConfig.max_num_seqs,
                   help="most requests running in one step")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help=f"most tokens computed in one step (default {DEFAULT_BATCHED_TOKENS}; when routed experts stream "
                        "over PCIe for prefill, the chunk the streaming cost model chooses, up to "
                        f"{MAX_AUTO_CHUNK})" + batched_note)


def _add_offload_flags(p: argparse.ArgumentParser) -> None:
    """Where routed experts go (`serve` and `plan` alike): see tandem/offload/placement.py."""
    from tandem.config import CPU_MOE_ACT_DTYPES, CPU_MOE_DTYPES, CPU_MOE_HANDOFFS

    p.add_argument("--cpu-moe", action="store_true",
                   help="keep every MoE layer's routed experts in system RAM and compute them on the CPU "
                        "(default: only when the model does not fit the GPU)")
    p.add_argument("--n-cpu-moe", type=int, default=None, metavar="N",
                   help="keep the routed experts of the first N layers in RAM, on the CPU (llama.cpp's flag)")
    p.add_argument("--gpu-resident-moe-layers", default=None, metavar="auto|none|I,J",
                   help="with experts offloaded, MoE layers kept whole on the GPU: auto (as many as the GPU budget "
                        "allows, the default when the model does not fit), none (the default with --cpu-moe), or "
                        "layer indices such as 0,1")
    p.add_argument("--cpu-moe-threads", type=int, default=None, metavar="N",
                   help="CPU expert kernel threads, pinned to cores (default: the usable cores less one, for the "
                        "thread that drives the GPU)")
    p.add_argument("--cpu-moe-dtype", default="auto", choices=CPU_MOE_DTYPES,
                   help="routed experts in RAM: auto keeps the checkpoint's values (bf16, fp32; MXFP4 as it is); "
                        "int8, int4 and mxfp4 from a bf16 checkpoint are LOSSY conversions")
    p.add_argument("--cpu-moe-act-dtype", default="auto", choices=CPU_MOE_ACT_DTYPES,
                   help="the CPU experts' activations: auto (fp32 math; bf16 pairs on avx512bf16 CPUs) or int8: "
                        "quantised per block of 32 for integer dot products with int4 / mxfp4 experts, faster to "
                        "decode and LOSSY (default: auto)")
    p.add_argument("--cpu-moe-handoff", default=OffloadConfig.cpu_moe_handoff, choices=CPU_MOE_HANDOFFS,
                   help="how the GPU stream hands each offloaded layer to the CPU experts and waits: hostfunc (a "
                        "CUDA host node) or poll (a thread polling pinned flags the stream writes and waits on; "
                        f"default: {OffloadConfig.cpu_moe_handoff})")
    p.add_argument("--cpu-memory", default=None, metavar="SIZE",
                   help="plan for a machine with this much RAM, e.g. 256GiB (default: this machine's available RAM)")
    p.add_argument("--hot-experts", default=None, metavar="FILE|online",
                   help="with experts in RAM, also keep the most-used ones on the GPU, as counted by "
                        "`tandem profile-experts` into FILE, or online: learned from the routing served and swapped "
                        "in between steps (with --hot-expert-memory)")
    p.add_argument("--hot-expert-memory", default=None, metavar="SIZE",
                   help="GPU memory for the hot experts, e.g. 4GiB")
    p.add_argument("--stream-experts", default="auto", choices=("auto", "on", "off"),
                   help="with experts in RAM, run long prefill steps on the GPU with the experts copied over PCIe: "
                        "auto (on CUDA, for steps of at least the cost model's threshold), on, off (default: auto)")
    p.add_argument("--stream-experts-min-tokens", type=int, default=None, metavar="N",
                   help="stream the experts for steps of at least N tokens (default: the cost model's threshold, "
                        "from PCIe and CPU-expert speed measured at start-up)")
    p.add_argument("--stream-experts-memory", default=None, metavar="SIZE",
                   help="GPU memory for expert streaming: the copy buffers and one unpacked group of experts "
                        "(default: 2GiB, or what a whole layer's experts need if less)")


def offload_config(args: argparse.Namespace) -> OffloadConfig:
    return OffloadConfig(
        cpu_moe=args.cpu_moe,
        n_cpu_moe=args.n_cpu_moe,
        gpu_resident_moe_layers=OffloadConfig.parse_layers(args.gpu_resident_moe_layers),
        cpu_moe_threads=args.cpu_moe_threads,
        cpu_moe_dtype=args.cpu_moe_dtype,
        cpu_memory=parse_size(args.cpu_memory) if args.cpu_memory else None,
        cpu_moe_act_dtype=args.cpu_moe_act_dtype,
        cpu_moe_handoff=args.cpu_moe_handoff,
        hot_experts=args.hot_experts,
        hot_expert_memory=parse_size(args.hot_expert_memory) if args.hot_expert_memory else None,
        stream_experts=args.stream_experts,
        stream_experts_min_tokens=args.stream_experts_min_tokens,
        stream_experts_memory=parse_size(args.stream_experts_memory) if args.stream_experts_memory else None,
    )


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, metavar="MODEL_DIR",
                   help="HF-format model directory, or a shipped model by name: tandem-demo (the trained demo "
                        "model) or tandem-builtin (tiny, random weights) (default: tandem-demo)")
    add_model_option(p)


def _add_serve_flags(s: argparse.ArgumentParser) -> None:
    from tandem.server.reasoning import reasoning_parser_names
    from tandem.server.tool_parsers import tool_parser_names

    _add_model_flags(s)
    s.add_argument("--host", default=ServerConfig.host, help="address to listen on (0.0.0.0: every interface)")
    s.add_argument("--port", type=int, default=ServerConfig.port, help="port to listen on (0: any free port)")
    s.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="names clients send as `model`: the first is the name in responses, requests may use any "
                        "of them, /v1/models lists them all (default: tandem-demo / tandem-builtin for the shipped "
                        "models, else the model directory's name)")
    # -- capacity and scheduling
    _add_capacity_flags(s, "; longer prompts are prefilled in chunks of this size")
    _bool_flag(s, "--enable-chunked-prefill", SchedulerConfig.enable_chunked_prefill,
               "prefill a long prompt in chunks of --max-num-batched-tokens, next to the running decodes; "
               "--no-enable-chunked-prefill prefills each prompt in one step, which needs --max-model-len at most "
               "--max-num-batched-tokens")
    _bool_flag(s, "--async-scheduling", None,
               "launch each decode step before the previous step's tokens are back on the host, so output, stop "
               "checks and scheduling overlap the GPU (default: on for CUDA); DSpark's verify steps go ahead too "
               "(not with penalties or logprobs); other verify steps, structured output or a preemption run "
               "synchronously")
    s.add_argument("--max-queued-requests", type=int, default=SchedulerConfig.max_queued_requests,
                   help="waiting requests beyond this get HTTP 503 with Retry-After")
    # -- memory and KV cache
    s.add_argument("--gpu-memory-utilization", type=float, default=CacheConfig.gpu_memory_utilization,
                   help="share of the GPU's memory Tandem may use; the KV cache gets what weights and activations "
                        "leave")
    s.add_argument("--kv-cache-memory", default=None, metavar="SIZE",
                   help="KV cache size, e.g. 4GiB; overrides --gpu-memory-utilization and works on CPU too "
                        "(default: what --gpu-memory-utilization leaves on CUDA, 4GiB on CPU)")
    s.add_argument("--kv-cache-dtype", default=CacheConfig.kv_cache_dtype, choices=KV_CACHE_DTYPES,
                   help="how KV pages are stored: auto (--dtype) or fp8 (e4m3 with a scale per vector: per token "
                        "and KV head; lossy, BENCHMARKS.md has its cost)")
    s.add_argument("--block-size", type=int, default=CacheConfig.block_size, metavar="N",
                   help=f"tokens per KV cache block: {', '.join(map(str, BLOCK_SIZES))}")
    _bool_flag(s, "--enable-prefix-caching", CacheConfig.enable_prefix_caching,
               "reuse the KV cache of shared prompt prefixes")
    # -- execution
    s.add_argument("--dtype", default="auto",
                   help="weights and activations: auto (bfloat16 on CUDA, float32 on CPU), bfloat16, float16 or "
                        "float32")
    s.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"],
                   help="auto: cuda when torch sees a GPU, else cpu")
    s.add_argument("--seed", type=int, default=0, help="seed of the sampler for requests that give none")
    s.add_argument("--enforce-eager", action="store_true",
                   help="never capture CUDA graphs (every step runs eagerly; for debugging)")
    s.add_argument("--prefill-graph-max-tokens", type=int, default=RunnerConfig.prefill_graph_max_tokens, metavar="N",
                   help="a step with prompt work (chunks of one or more prompts, beside decodes) of up to N tokens "
                        "replays a CUDA graph (captured at 8, 16, .. N tokens; at most --max-num-batched-tokens); 0: "
                        "prefill runs eagerly")
    _bool_flag(s, "--fused-ops", RunnerConfig.fused_ops,
               "fused Triton kernels for RMSNorm, rotary, SiLU*up, routing and small-batch MoE on CUDA (2.5x "
               "batch-1 decode on an H200); --no-fused-ops runs the torch reference")
    s.add_argument("--attention-backend", default="auto", choices=("auto", "torch", "triton"),
                   help="auto: Triton paged attention on CUDA, the torch reference elsewhere")
    s.add_argument("--moe-backend", default="auto", choices=("auto", "torch", "grouped"),
                   help="auto: grouped-GEMM experts on CUDA in bf16/fp16, the torch reference elsewhere")
    _add_offload_flags(s)
    s.add_argument("--cpu-threads", type=int, default=None, metavar="N",
                   help="torch threads for CPU work (default: the cores this process may use, less one for the "
                        "server thread)")
    s.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, vLLM\'s keys, e.g. \'{"method": "ngram", "num_speculative_tokens": 3, '
                        '"prompt_lookup_max": 3}\'; plus "adaptive": "phase" with "phase_k": {"reasoning": 1, '
                        '"content": 2} for a draft depth per request phase, or "adaptive": "auto" for a depth per '
                        'request and step from measured acceptance and step costs (default: off)')
    # -- the API
    s.add_argument("--api-key", default=os.environ.get("TANDEM_API_KEY"),
                   help="require `Authorization: Bearer KEY` (default: $TANDEM_API_KEY)")
    s.add_argument("--reasoning-parser", default=None, choices=[*reasoning_parser_names(), "none"],
                   help="split reasoning from content (default: qwen3 for the shipped models, else none)")
    s.add_argument("--tool-call-parser", default=None, choices=[*tool_parser_names(), "none"],
                   help="parse tool calls in chat outputs into `tool_calls` (default: hermes for the shipped models, "
                        "else none)")
    _bool_flag(s, "--enable-auto-tool-choice", None,
               'let the model decide when to call a tool (`"tool_choice": "auto"`); needs --tool-call-parser '
               "(default: on for the shipped models, else off)")
    s.add_argument("--chat-template", default=None,
                   help="path to a jinja chat template, or the template itself (default: the tokenizer's)")
    s.add_argument("--default-chat-template-kwargs", default=None, metavar="JSON",
                   help='defaults for chat_template_kwargs, e.g. \'{"enable_thinking": false}\' (default: {})')
    s.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                   help="sampling defaults for the fields a request leaves out: auto, the model directory's "
                        "generation_config.json; vllm, none (Tandem's own); DIR, DIR/generation_config.json")
    s.add_argument("--max-logprobs", type=int, default=MAX_LOGPROBS, metavar="N",
                   help=f"most top logprobs one request may ask for (logprobs, top_logprobs), 0..{MAX_LOGPROBS}")
    s.add_argument("--max-n", type=int, default=ServerConfig.max_n, help="most choices (`n`) one request may ask for")
    s.add_argument("--max-prompts-per-request", type=int, default=ServerConfig.max_prompts,
                   help="most prompts in one /v1/completions request")
    s.add_argument("--chat-template-timeout", type=float, default=ServerConfig.render_timeout, metavar="SECONDS",
                   help="a chat template render that runs longer is stopped and the request gets HTTP 400")
    s.add_argument("--shutdown-timeout", type=float, default=ServerConfig.shutdown_timeout, metavar="SECONDS",
                   help="seconds running requests may finish after SIGINT/SIGTERM")
    # -- logging
    s.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="level of Tandem's own log")
    s.add_argument("--uvicorn-log-level", default=None, choices=UVICORN_LOG_LEVELS,
                   help="level of uvicorn's loggers; its access log writes a line per request at info "
                        "(default: --log-level)")
    s.add_argument("--disable-log-stats", action="store_true",
                   help="no periodic engine stats line in the log (/metrics is unaffected)")
    add_accepted_flags(s)


def _add_plan_flags(p: argparse.ArgumentParser) -> None:
    _add_model_flags(p)
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"],
                   help="auto: cuda when torch sees a GPU, else cpu")
    p.add_argument("--dtype", default="auto", help="auto, bfloat16, float16 or float32")
    p.add_argument("--gpu-memory", default=None, help="plan for a GPU of this size, e.g. 24GiB (default: this GPU)")
    p.add_argument("--gpu-memory-utilization", type=float, default=CacheConfig.gpu_memory_utilization,
                   help="share of the GPU's memory Tandem may use")
    p.add_argument("--kv-cache-memory", default=None, help="KV cache size, e.g. 4GiB (default: from "
                                                          "--gpu-memory-utilization)")
    p.add_argument("--kv-cache-dtype", default=CacheConfig.kv_cache_dtype, choices=KV_CACHE_DTYPES,
                   help="as serve's: auto (--dtype) or fp8")
    _add_capacity_flags(p)
    _add_offload_flags(p)
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="as serve's: a draft model or DSpark drafter takes its weights' share of the GPU")
    p.add_argument("--measure", action="store_true",
                   help="time RAM read, PCIe and GPU bandwidth here and print the predicted decode tok/s")


def build_parser() -> FlagParser:
    parser = FlagParser(prog="tandem", description="Serve Mixture-of-Experts LLMs behind an OpenAI-compatible API.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # Whole flag names only (no abbreviations): `--max-num-seq` is a typo to point out, and a vLLM
    # flag that happens to prefix one of Tandem's must not be taken for it.
    serve_parser = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server", formatter_class=HelpFormatter,
                                  description="Run the OpenAI-compatible HTTP server. Flags follow vLLM's names.",
                                  allow_abbrev=False)
    _add_serve_flags(serve_parser)
    plan_parser = sub.add_parser("plan", help="print where weights and KV cache go, and whether it fits, without "
                                              "loading (MODEL_DIR may be a config.json alone: planned from the "
                                              "architecture, before downloading the weights)",
                                 formatter_class=HelpFormatter, allow_abbrev=False)
    _add_plan_flags(plan_parser)
    from tandem.offload import profile

    profile_parser = profile.add_parser(sub, HelpFormatter)
    # Listed for --help only: `run` hands `tandem bench ...` to tandem.bench.cli before this parser
    # sees it, so serving never imports the client-side bench code (httpx and the tools).
    sub.add_parser("bench", add_help=False, help="benchmark and quality tools for any OpenAI-compatible server "
                                                 "(`tandem bench --help` lists them)")
    parser.commands = {"serve": serve_parser, "plan": plan_parser, "profile-experts": profile_parser}
    return parser


def plan(args: argparse.Namespace) -> int:
    """`tandem plan`: exit 0 when the plan fits, 1 when it does not (the reasons are printed)."""
    from tandem.offload.planner import plan_memory

    # --gpu-memory plans for a GPU that need not be here, so it implies CUDA.
    device = "cuda" if args.device == "cuda" or (args.device == "auto" and args.gpu_memory) else resolve_device(args.device)
    if args.model and Path(args.model).is_file():  # a config.json alone: planned from the architecture
        model_dir = args.model
    else:
        shipped, model_dir = shipped_model(args.model)
        if shipped == "builtin":
            from tandem.builtin import ensure_builtin_model

            model_dir = str(ensure_builtin_model())
    from tandem.models.loader import CheckpointError

    try:
        result = plan_memory(
            model_dir, resolve_dtype(args.dtype, device), device,
            max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, gpu_memory_utilization=args.gpu_memory_utilization,
            kv_cache_memory=parse_size(args.kv_cache_memory) if args.kv_cache_memory else None,
            kv_cache_dtype=args.kv_cache_dtype,
            device_bytes=parse_size(args.gpu_memory) if args.gpu_memory else None,
            offload=offload_config(args), machine=_measured(args, device),
            spec=SpecConfig.parse(args.speculative_config),
        )
    except (CheckpointError, ValueError) as e:
        sys.stderr.write(f"tandem: error: {e}\n")
        return 1
    print(result.render())
    return 0 if result.fits else 1


def _measured(args: argparse.Namespace, device: str) -> MachineConstants | None:
    if not args.measure:
        return None
    from tandem.offload.measure import measure_machine

    return measure_machine(device, threads=args.cpu_moe_threads)


def _json_object(text: str | None, flag: str) -> dict[str, Any]:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag} is not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object")
    return value


def _check_flags(args: argparse.Namespace) -> None:
    """Range checks of the serve flags that no config object makes itself."""
    if args.max_model_len is not None and args.max_model_len <= 0:
        raise ValueError("--max-model-len must be positive")
    if not 0 < args.port < 65536 and args.port != 0:
        raise ValueError("--port must be in 0..65535")
    if args.max_queued_requests < 0:
        raise ValueError("--max-queued-requests must be non-negative")
    if args.max_n < 1 or args.max_prompts_per_request < 1:
        raise ValueError("--max-n and --max-prompts-per-request must be at least 1")
    if not SEED_MIN <= args.seed < SEED_END:
        raise ValueError(f"--seed must be in [-2^63, 2^64), got {args.seed}")
    if not args.chat_template_timeout > 0:
        raise ValueError("--chat-template-timeout must be positive")
    if not 0 <= args.max_logprobs <= MAX_LOGPROBS:
        raise ValueError(f"--max-logprobs must be in 0..{MAX_LOGPROBS} (Tandem returns at most {MAX_LOGPROBS} top "
                         f"logprobs per token), got {args.max_logprobs}")
    if not args.enable_chunked_prefill and (args.max_model_len is None
                                            or args.max_model_len > (args.max_num_batched_tokens
                                                                     or DEFAULT_BATCHED_TOKENS)):
        # Without chunks a prompt longer than one step's token budget would wait forever.
        got = "none" if args.max_model_len is None else args.max_model_len
        raise ValueError("--no-enable-chunked-prefill prefills each prompt in one step, so it needs --max-model-len "
                         f"at most --max-num-batched-tokens ({args.max_num_batched_tokens or DEFAULT_BATCHED_TOKENS}); "
                         f"--max-model-len is {got}")
    if args.generation_config not in ("auto", "vllm"):  # DIR: its file is read and checked before the model loads
        from tandem.tokenizer import read_generation_defaults

        read_generation_defaults(args.generation_config)  # TokenizerError (a ValueError) naming the file


def _served_names(args: argparse.Namespace, model_dir: str, shipped: str | None) -> tuple[str, ...]:
    """--served-model-name's names without repeats; by default the shipped model's name or the
    directory's."""
    from tandem.builtin import BUILTIN_NAME, DEMO_NAME

    if args.served_model_name:
        if not all(name.strip() for name in args.served_model_name):
            raise ValueError("--served-model-name: a name must not be empty")
        return tuple(dict.fromkeys(args.served_model_name))
    if shipped is not None:
        return (BUILTIN_NAME if shipped == "builtin" else DEMO_NAME,)
    return (Path(model_dir).resolve().name,)


def _tool_call_parser(args: argparse.Namespace, shipped: str | None) -> tuple[str | None, bool]:
    """(--tool-call-parser, --enable-auto-tool-choice) with the shipped models' defaults, and vLLM's
    rule that auto tool choice needs a parser."""
    name = args.tool_call_parser or (SHIPPED_TOOL_CALL_PARSER if shipped else None)
    name = None if name == "none" else name
    auto = args.enable_auto_tool_choice
    if auto is None:
        auto = shipped is not None and name is not None
    if auto and name is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser NAME (e.g. hermes)")
    return name, auto


def build_configs(args: argparse.Namespace, model_dir: str, shipped: str | None = None
                  ) -> tuple[EngineConfig, ServerConfig]:
    """Flags -> frozen configs; raises ValueError with a message that names the flag.

    `shipped` is what `shipped_model` says MODEL_DIR is ("demo", "builtin" or None); the shipped
    models default to their names, the qwen3 reasoning parser and the hermes tool-call parser."""
    _check_flags(args)
    device = resolve_device(args.device)
    names = _served_names(args, model_dir, shipped)
    model = ModelConfig(
        model=model_dir,
        dtype=resolve_dtype(args.dtype, device),
        device=device,
        max_model_len=args.max_model_len,
        served_model_name=names[0],
        chat_template=args.chat_template,
        seed=args.seed,
        generation_config=args.generation_config,
    )
    cache = CacheConfig(
        block_size=args.block_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory=parse_size(args.kv_cache_memory) if args.kv_cache_memory else None,
        enable_prefix_caching=args.enable_prefix_caching,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    scheduler = SchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_queued_requests=args.max_queued_requests,
        enable_chunked_prefill=args.enable_chunked_prefill,
        async_scheduling=args.async_scheduling,
    )
    reasoning = args.reasoning_parser or (SHIPPED_REASONING_PARSER if shipped else None)
    tool_parser, auto_tool_choice = _tool_call_parser(args, shipped)
    server = ServerConfig(
        host=args.host,
        port=args.port,
        api_key=args.api_key or None,
        served_model_names=names,
        reasoning_parser=None if reasoning == "none" else reasoning,
        tool_call_parser=tool_parser,
        enable_auto_tool_choice=auto_tool_choice,
        default_chat_template_kwargs=_json_object(args.default_chat_template_kwargs, "--default-chat-template-kwargs"),
        shutdown_timeout=args.shutdown_timeout,
        max_n=args.max_n,
        max_prompts=args.max_prompts_per_request,
        max_logprobs=args.max_logprobs,
        render_timeout=args.chat_template_timeout,
        uvicorn_log_level=args.uvicorn_log_level or args.log_level,
    )
    runner = RunnerConfig(args.attention_backend, args.moe_backend, args.enforce_eager, args.fused_ops,
                          args.cpu_threads, args.prefill_graph_max_tokens)
    spec = SpecConfig.parse(args.speculative_config)
    stats_interval = math.inf if args.disable_log_stats else EngineConfig.log_stats_interval
    engine = EngineConfig(model=model, cache=cache, scheduler=scheduler, spec=spec, runner=runner,
                          offload=offload_config(args), log_stats_interval=stats_interval)
    return engine, server


def shipped_model(model: str | None) -> tuple[str | None, str | None]:
    """Resolve the MODEL argument: ("demo", its directory), ("builtin", None: generated when the
    engine loads) or (None, the directory given). A directory of the same name wins over a name."""
    from tandem.builtin import BUILTIN_NAME, DEMO_NAME, demo_model_dir

    name = model or DEMO_NAME
    if name in (BUILTIN_NAME, DEMO_NAME) and not Path(name).is_dir():
        if name == BUILTIN_NAME:
            return "builtin", None
        try:
            return "demo", str(demo_model_dir())
        except FileNotFoundError as e:
            raise ValueError(str(e)) from None
    if not Path(name).is_dir():
        raise ValueError(f"model directory {name!r} does not exist (shipped models: {DEMO_NAME}, {BUILTIN_NAME})")
    return None, name


def serve(args: argparse.Namespace) -> int:
    shipped, model_dir = shipped_model(args.model)
    if args.chat_template:  # a missing file or a syntax error is a flag error: report it before loading
        from tandem.server.chat_template import ChatTemplate, resolve_template_source

        ChatTemplate(resolve_template_source(args.chat_template, None))
    engine_cfg, server_cfg = build_configs(args, model_dir or "<built-in>", shipped)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    if args.trust_remote_code:
        logger.info("--trust-remote-code changes nothing: Tandem never runs code from a checkpoint, it loads only "
                    "the architectures it implements")
    return asyncio.run(serve_until_exit(engine_cfg, server_cfg, shipped == "builtin", server_cfg.uvicorn_log_level))


def run(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        from tandem.bench.cli import main as bench_main

        return bench_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "serve":
            return serve(args)
        if args.command == "plan":
            return plan(args)
        if args.command == "profile-experts":
            from tandem.offload import profile

            return profile.run(args)
    except ValueError as e:
        parser.commands.get(args.command, parser).error(str(e))
    except OSError as e:
        sys.stderr.write(f"tandem: error: {e}\n")
        return 1
    return 2


def main(argv: list[str] | None = None) -> None:
    sys.exit(run(argv))


if __name__ == "__main__":
    main()
