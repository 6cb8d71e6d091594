"""`tandem profile-experts MODEL --prompts FILE`: count how often each MoE layer routes to each
expert while Tandem's own engine generates for the prompts, into the calibration file that
`--hot-experts` reads (hot_experts.py). Prompts and outputs both count: decode is what the hot
experts serve, and its routing follows the model's own tokens.

FILE holds one prompt per line: plain text, or JSON lines with "prompt" (text) or "messages"
(a chat, rendered with the checkpoint's chat template)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

logger = logging.getLogger("tandem")


def add_parser(sub: argparse._SubParsersAction, formatter: type) -> argparse.ArgumentParser:
    p = sub.add_parser("profile-experts", formatter_class=formatter, allow_abbrev=False,
                       help="count each MoE layer's expert routing over a prompt file, for --hot-experts",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("model", metavar="MODEL_DIR", help="HF-format model directory")
    p.add_argument("--prompts", required=True, metavar="FILE", help="one prompt per line: text, or JSON with "
                   '"prompt" or "messages"')
    p.add_argument("--out", default="expert_counts.json", metavar="FILE", help="the calibration file to write")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens generated (greedily) per prompt")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"],
                   help="auto: cuda when torch sees a GPU, else cpu")
    p.add_argument("--dtype", default="auto", help="auto, bfloat16, float16 or float32")
    p.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output, in tokens")
    p.add_argument("--kv-cache-memory", default=None, metavar="SIZE", help="KV cache size, e.g. 4GiB")
    p.add_argument("--cpu-moe", action="store_true", help="routed experts in RAM while profiling (a model larger "
                                                          "than the GPU)")
    return p


def read_prompts(path: Path) -> list[str | list[dict]]:
    """Text prompts and chats (lists of messages), in file order; ValueError naming the line."""
    prompts: list[str | list[dict]] = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                item = json.loads(line)
                prompts.append(item["messages"] if "messages" in item else str(item["prompt"]))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{n}: a JSON line needs \"prompt\" or \"messages\" ({e})") from None
        else:
            prompts.append(line)
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def run(args: argparse.Namespace) -> int:
    from tandem import LLM, SamplingParams
    from tandem.offload.hot_experts import ExpertCounts, record_routing

    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    prompts = read_prompts(Path(args.prompts))
    llm = LLM(args.model, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
              kv_cache_memory=args.kv_cache_memory, cpu_moe=args.cpu_moe)
    model = llm.engine.model
    if not hasattr(model, "moe_blocks") or not model.moe_blocks():
        raise ValueError(f"{args.model}: the model has no MoE layers to profile")
    ids = [llm.tokenizer.encode(p) if isinstance(p, str) else llm.chat_prompt(p) for p in prompts]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    with record_routing(model) as counts:
        outs = llm.generate(ids, params, use_tqdm=sys.stderr.isatty())
    layer_counts = {i: tuple(c.tolist()) for i, c in counts.items()}
    top_k = next(iter(model.moe_blocks().values())).top_k
    tokens = sum(next(iter(layer_counts.values()))) // top_k  # the tokens that ran (a last output token does not)
    result = ExpertCounts(Path(args.model).resolve().name, tokens, layer_counts)
    logger.info("profiled %d prompts, %d output tokens", len(outs), sum(len(o.token_ids) for o in outs))
    result.save(args.out)
    spread = [max(c) / (sum(c) / len(c)) for c in result.counts.values() if sum(c)]
    print(f"{args.out}: routing of {tokens} tokens over {len(result.counts)} MoE layers "
          f"(busiest expert {min(spread):.1f}-{max(spread):.1f}x a layer's mean)")
    return 0
