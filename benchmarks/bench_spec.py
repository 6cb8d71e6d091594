"""Speculative decoding on the demo model, offline through `tandem.LLM`: no speculation against n-gram
drafting at fixed K and by phase, at concurrency 1 and 8, greedy, over held-out demo prompts.

For each configuration: output tok/s, drafts and acceptance (from the engine's `tandem:spec_decode_*`
counters), CUDA-graph vs eager steps, and how many outputs equal the non-speculative ones token for
token (on CUDA in bf16, batch shapes change the arithmetic, so a difference is possible; on CPU in
fp32 the tests require equality).

    python benchmarks/bench_spec.py --device cuda --n 3 --out spec.json
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


def prompts(n: int) -> list[list[int]]:
    tok = text.load_tokenizer(demo_model_dir() / "tokenizer.json")
    exs = [make_example(EVAL_SEED, i, family) for family in FAMILIES for i in range(n)]
    return [tok.encode(text.render_prompt(ex), add_special_tokens=False).ids for ex in exs]


def counter(llm: LLM, name: str, **labels: str) -> float:
    """Sum of a counter's samples whose labels include `labels`."""
    total = 0.0
    for metric in llm.engine.metrics.registry.collect():
        for s in metric.samples:
            if s.name == f"{name}_total" and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def run(device: str, spec: dict | None, concurrency: int, ids: list[list[int]], max_tokens: int) -> dict[str, Any]:
    llm = LLM(str(demo_model_dir()), device=device, max_num_seqs=max(concurrency, 1), kv_cache_memory="2GiB",
              speculative_config=spec)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0)
    llm.generate(ids[:2], sp)  # warm-up (kernels, allocator)
    before = {k: counter(llm, f"tandem:{k}") for k in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                                                       "spec_decode_num_accepted_tokens")}
    graphs0, eager0 = counter(llm, "tandem:model_steps", mode="cuda_graph"), counter(llm, "tandem:model_steps", mode="eager")
    start = time.perf_counter()
    outs = []
    if concurrency == 1:
        for p in ids:
            outs += llm.generate([p], sp)
    else:
        outs = llm.generate(ids, sp)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    drafts = counter(llm, "tandem:spec_decode_num_drafts") - before["spec_decode_num_drafts"]
    drafted = counter(llm, "tandem:spec_decode_num_draft_tokens") - before["spec_decode_num_draft_tokens"]
    accepted = counter(llm, "tandem:spec_decode_num_accepted_tokens") - before["spec_decode_num_accepted_tokens"]
    per_phase = {ph: counter(llm, "tandem:spec_decode_num_accepted_tokens", phase=ph)
                 / max(1.0, counter(llm, "tandem:spec_decode_num_draft_tokens", phase=ph))
                 for ph in ("reasoning", "content", "tool_call")}
    return {
        "spec": spec, "concurrency": concurrency, "seconds": round(seconds, 3), "tokens": tokens,
        "tok_s": round(tokens / seconds, 1), "drafts": drafts, "draft_tokens": drafted, "accepted": accepted,
        "acceptance": round(accepted / drafted, 3) if drafted else None,
        "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else None,
        "acceptance_by_phase": {k: round(v, 3) for k, v in per_phase.items()},  # warm-up included
        "graph_steps": counter(llm, "tandem:model_steps", mode="cuda_graph") - graphs0,
        "eager_steps": counter(llm, "tandem:model_steps", mode="eager") - eager0,
        "outputs": [o.token_ids for o in outs],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--n", type=int, default=3, help="held-out prompts per task family")
    ap.add_argument("--ks", default="1,2,3,4")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    ids = prompts(args.n)
    specs: list[dict | None] = [None]
    specs += [{"method": "ngram", "num_speculative_tokens": int(k)} for k in args.ks.split(",")]
    specs.append({"method": "ngram", "num_speculative_tokens": 3, "adaptive": "phase",
                  "phase_k": {"reasoning": 3, "content": 2, "tool_call": 1}})
    run(args.device, None, 1, ids[:4], args.max_tokens)  # process warm-up (JIT, clocks): not measured
    rows = []
    for conc in (int(c) for c in args.concurrency.split(",")):
        # Bracketed: the baseline runs first and again last; speed-ups are against the slower of the two
        # only if they disagree by little (both are in the output).
        results = [run(args.device, spec, conc, ids, args.max_tokens) for spec in [*specs, None]]
        base_outputs = results[0]["outputs"]
        base_tok_s = (results[0]["tok_s"] + results[-1]["tok_s"]) / 2
        for r in results:
            outputs = r.pop("outputs")
            r["equal_to_no_spec"] = f"{sum(a == b for a, b in zip(outputs, base_outputs))}/{len(outputs)}"
            r["speedup_vs_mean_baseline"] = round(r["tok_s"] / base_tok_s, 3)
            rows.append(r)
            print(json.dumps(r), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"prompts": len(ids), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
