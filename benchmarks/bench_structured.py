"""The per-token cost of structured output on the demo model: output tok/s with and without a
`json_schema` grammar, in one process, offline through `tandem.LLM`.

Each configuration runs the demo's held-out prompts (thinking on, greedy) at concurrency 1 and 8:
free output, then the same prompts constrained to a JSON schema after the reasoning (the grammar the
server writes for `response_format: json_schema`; the reasoning stays free but is masked too). Besides
tok/s it reports the time spent in the grammar stage itself (mask building, masking, token
consumption; timed around the `StructuredOutputs` calls and `apply_token_bitmask`) per constrained
token, and checks that every constrained answer parses as JSON.

    python benchmarks/bench_structured.py --device cuda --n 2 --out structured.json
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from tandem import LLM, SamplingParams
from tandem.builtin import demo_model_dir
from tandem.demo import text
from tandem.demo.corpus import EVAL_SEED, FAMILIES, make_example
from tandem.engine import structured
from tandem.engine.structured import json_schema_grammar

SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "maxLength": 80},
        "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        "facts": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 3},
    },
    "required": ["answer", "confidence", "facts"],
    "additionalProperties": False,
}
GRAMMAR = json_schema_grammar(SCHEMA, ("<think>", "</think>"))


class _Timer:
    """Wall time spent inside the wrapped functions."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._undo: list[tuple[Any, str, Any]] = []

    def wrap(self, owner: Any, name: str) -> None:
        inner = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        self._undo.append((owner, name, inner))
        setattr(owner, name, timed)

    def restore(self) -> None:
        for owner, name, inner in reversed(self._undo):
            setattr(owner, name, inner)
        self._undo = []


def prompts(n: int) -> list[list[int]]:
    tok = text.load_tokenizer(demo_model_dir() / "tokenizer.json")
    exs = [make_example(EVAL_SEED, i, family) for family in FAMILIES for i in range(n)]
    return [tok.encode(text.render_prompt(ex), add_special_tokens=False).ids for ex in exs]


def run(llm: LLM, ids: list[list[int]], grammar: str | None, concurrency: int, max_tokens: int) -> dict[str, Any]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, grammar=grammar)
    tokens, elapsed, valid, finished = 0, 0.0, 0, 0
    cache = llm.engine.structured.mask_cache
    hits0, misses0 = cache.hits, cache.misses
    timer = _Timer()
    for name in ("fill", "accept", "cut_drafts"):
        timer.wrap(llm.engine.structured, name)
    timer.wrap(structured, "apply_token_bitmask")  # what StepMasks.apply calls
    try:
        for start in range(0, len(ids), concurrency):
            batch = ids[start : start + concurrency]
            t0 = time.perf_counter()
            outs = llm.generate(batch, params)
            elapsed += time.perf_counter() - t0
            for c in outs:
                tokens += len(c.token_ids)
                finished += c.finish_reason == "stop"
                if grammar is not None and "</think>" in c.text:
                    try:
                        json.loads(c.text.split("</think>", 1)[1])
                        valid += 1
                    except json.JSONDecodeError:
                        pass
    finally:
        timer.restore()
    return {
        "grammar": grammar is not None, "concurrency": concurrency, "requests": len(ids), "tokens": tokens,
        "seconds": elapsed, "tok_s": tokens / elapsed, "stopped": finished,
        "valid_json": valid if grammar is not None else None,
        "grammar_us_per_token": timer.seconds / tokens * 1e6 if grammar is not None else None,
        "mask_cache_hits": cache.hits - hits0, "mask_cache_misses": cache.misses - misses0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--n", type=int, default=2, help="held-out prompts per task family")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=2, help="interleaved repetitions of each configuration")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    llm = LLM(str(demo_model_dir()), device=args.device, dtype=args.dtype, max_model_len=8192, max_num_seqs=8)
    ids = prompts(args.n)
    run(llm, ids[:2], GRAMMAR, 2, 64)  # warm-up: graphs, the grammar tokenizer
    results = []
    for rep in range(args.repeats):
        for conc in (int(c) for c in args.concurrency.split(",")):
            for grammar in (None, GRAMMAR):  # interleaved: drift hits both alike
                r = run(llm, ids, grammar, conc, args.max_tokens) | {"repeat": rep}
                results.append(r)
                looked_up = max(1, r["mask_cache_hits"] + r["mask_cache_misses"])
                extra = (f", grammar {r['grammar_us_per_token']:.1f} us/token, valid JSON {r['valid_json']}/{r['requests']}, "
                         f"mask cache hits {r['mask_cache_hits'] / looked_up:.0%}" if grammar else "")
                print(f"rep {rep} conc {conc} {'json_schema' if grammar else 'free':11s}: {r['tok_s']:8.1f} tok/s "
                      f"({r['tokens']} tokens in {r['seconds']:.2f} s){extra}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": str(llm.engine.device), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
