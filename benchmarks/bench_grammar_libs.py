"""Per-token cost of a JSON-schema grammar mask: llguidance against xgrammar, on the demo tokenizer.

Both libraries are what vLLM uses for structured output; Tandem picked one by this measurement (and
by how it fits the sampler, BENCHMARKS.md). Each library compiles the same schema, then walks a
schema-valid JSON document token by token, as constrained decoding does: compute the next-token
bitmask, check that the document's next token is allowed, consume it. Reported per token: mask
time and consume time (median and p90 over the walk, after one warm-up walk), and compile time.

    python benchmarks/bench_grammar_libs.py --repeats 20

xgrammar needs `transformers` (its tokenizer wrapper); a library that is not installed is skipped.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from tokenizers import Tokenizer

from tandem.builtin import demo_model_dir

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "units": {"enum": ["metric", "imperial"]},
        "hours": {"type": "array", "items": {"type": "number"}, "maxItems": 8},
        "alerts": {
            "type": "array",
            "items": {"type": "object", "properties": {"kind": {"type": "string"}, "level": {"type": "integer"}},
                      "required": ["kind", "level"], "additionalProperties": False},
        },
    },
    "required": ["city", "days", "units", "hours", "alerts"],
    "additionalProperties": False,
}
DOCUMENT = json.dumps({
    "city": "Lima", "days": 3, "units": "metric", "hours": [12.5, 13.0, 14.25, 15.5],
    "alerts": [{"kind": "wind", "level": 2}, {"kind": "fog", "level": 1}],
})


def _quantiles(xs: list[float]) -> tuple[float, float]:
    xs = sorted(xs)
    return statistics.median(xs), xs[int(0.9 * (len(xs) - 1))]


def walk(mask: Callable[[], None], allowed: Callable[[int], bool], consume: Callable[[int], None],
         reset: Callable[[], None], tokens: list[int]) -> tuple[list[float], list[float]]:
    masks, consumes = [], []
    reset()
    for t in tokens:
        t0 = time.perf_counter()
        mask()
        t1 = time.perf_counter()
        if not allowed(t):
            raise AssertionError(f"token {t} of the document is not allowed by the grammar")
        consume(t)
        t2 = time.perf_counter()
        masks.append(t1 - t0)
        consumes.append(t2 - t1)
    return masks, consumes


def bench_llguidance(tokenizer_json: Path, tokens: list[int], vocab: int, eos: int) -> dict:
    import llguidance
    import torch

    t0 = time.perf_counter()
    lltok = llguidance.LLTokenizer(tokenizer_json.read_text(), n_vocab=vocab, eos_token=eos)
    tok_s = time.perf_counter() - t0
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    t0 = time.perf_counter()
    matcher = llguidance.LLMatcher(lltok, grammar)
    compile_s = time.perf_counter() - t0
    bits = torch.zeros((vocab + 31) // 32, dtype=torch.int32)

    def mask() -> None:
        matcher.unsafe_compute_mask_ptr(bits.data_ptr(), bits.numel() * 4)

    def allowed(t: int) -> bool:
        return bool((int(bits[t // 32]) >> (t % 32)) & 1)

    return {"tokenizer_s": tok_s, "compile_s": compile_s, "walk": (mask, allowed, matcher.consume_token, matcher.reset)}


def bench_xgrammar(tokenizer_json: Path, tokens: list[int], vocab: int, eos: int) -> dict:
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    t0 = time.perf_counter()
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json), eos_token="<|im_end|>")
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info)
    tok_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA))
    matcher = xgr.GrammarMatcher(compiled)
    compile_s = time.perf_counter() - t0
    bits = xgr.allocate_token_bitmask(1, vocab)

    def mask() -> None:
        matcher.fill_next_token_bitmask(bits)

    def allowed(t: int) -> bool:
        return bool((int(bits[0, t // 32]) >> (t % 32)) & 1)

    def consume(t: int) -> None:
        if not matcher.accept_token(t):
            raise AssertionError(f"xgrammar refused token {t}")

    return {"tokenizer_s": tok_s, "compile_s": compile_s, "walk": (mask, allowed, consume, matcher.reset)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=20, help="walks of the document per library (after one warm-up)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    model = demo_model_dir()
    tokenizer_json = model / "tokenizer.json"
    config = json.loads((model / "config.json").read_text())
    vocab = config["vocab_size"]
    tok = Tokenizer.from_file(str(tokenizer_json))
    eos = tok.token_to_id("<|im_end|>")
    tokens = tok.encode(DOCUMENT, add_special_tokens=False).ids + [eos]
    results = {}
    for name, fn in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar)):
        try:
            setup = fn(tokenizer_json, tokens, vocab, eos)
        except ImportError as e:
            print(f"{name}: not installed ({e}); skipped")
            continue
        masks: list[float] = []
        consumes: list[float] = []
        walk(*setup["walk"], tokens)  # warm-up
        for _ in range(args.repeats):
            m, c = walk(*setup["walk"], tokens)
            masks += m
            consumes += c
        mask_med, mask_p90 = _quantiles(masks)
        cons_med, cons_p90 = _quantiles(consumes)
        results[name] = {
            "tokenizer_setup_ms": setup["tokenizer_s"] * 1e3, "compile_ms": setup["compile_s"] * 1e3,
            "mask_us_median": mask_med * 1e6, "mask_us_p90": mask_p90 * 1e6,
            "consume_us_median": cons_med * 1e6, "consume_us_p90": cons_p90 * 1e6,
        }
        print(f"{name:11s} tokenizer setup {setup['tokenizer_s'] * 1e3:7.1f} ms  compile {setup['compile_s'] * 1e3:6.2f} ms  "
              f"mask {mask_med * 1e6:6.1f} us (p90 {mask_p90 * 1e6:6.1f})  consume {cons_med * 1e6:5.1f} us "
              f"(p90 {cons_p90 * 1e6:5.1f})  over {len(tokens)} tokens x {args.repeats}")
    if args.out:
        Path(args.out).write_text(json.dumps({"vocab": vocab, "tokens": len(tokens), "results": results}, indent=2))


if __name__ == "__main__":
    main()
