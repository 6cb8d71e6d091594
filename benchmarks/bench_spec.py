"""Speculative decoding on the demo pair, offline through `tandem.LLM`: no speculation against each
method (n-gram, draft model, DSpark) at fixed K and by phase, at concurrency 1 and 8, greedy, over
the demo's held-out prompts with thinking on.

For each configuration: output tok/s, drafts and acceptance overall, by position and by phase (from
the engine's `tandem:spec_decode_*` counters, warm-up excluded), the K distribution, target steps by
mode (CUDA graph / eager decode-or-verify / prefill) and drafter forwards by mode, and how many
outputs equal the non-speculative ones token for token (on CUDA in bf16, batch shapes change the
arithmetic, so a difference is possible; on CPU in fp32 the tests require equality).

    python benchmarks/bench_spec.py --device cuda --methods dspark,draft_model --n 2 --out spec.json
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


PHASES = ("reasoning", "content", "tool_call")


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
    snap0 = snapshot(llm)
    start = time.perf_counter()
    outs = []
    if concurrency == 1:
        for p in ids:
            outs += llm.generate([p], sp)
    else:
        outs = llm.generate(ids, sp)
    seconds = time.perf_counter() - start
    d = {k: v - snap0.get(k, 0.0) for k, v in snapshot(llm).items()}
    tokens = sum(len(o.token_ids) for o in outs)

    def acceptance(phase: str | None) -> dict[str, Any] | None:
        key = "" if phase is None else f"/{phase}"
        drafts, drafted = d.get(f"drafts{key}", 0.0), d.get(f"draft_tokens{key}", 0.0)
        if not drafts:
            return None
        accepted = d.get(f"accepted{key}", 0.0)
        per_pos = [round(d.get(f"pos{i}{key}", 0.0) / drafts, 3) for i in range(8) if d.get(f"pos{i}{key}", 0.0)]
        return {"drafts": drafts, "draft_tokens": drafted, "accepted": accepted,
                "rate": round(accepted / drafted, 3), "mean_acceptance_length": round(1 + accepted / drafts, 3),
                "per_position": per_pos}

    k_dist = {ph: {k.split("=")[1]: v for k, v in d.items() if k.startswith(f"k/{ph}=") and v}
              for ph in PHASES}
    return {
        "spec": spec, "concurrency": concurrency, "seconds": round(seconds, 3), "tokens": tokens,
        "tok_s": round(tokens / seconds, 1), "acceptance": acceptance(None),
        "acceptance_by_phase": {ph: acceptance(ph) for ph in PHASES if acceptance(ph)},
        "k_distribution": {ph: v for ph, v in k_dist.items() if v},
        "target_steps": {m: d.get(f"steps/{m}", 0.0) for m in ("cuda_graph", "eager", "prefill", "prefill_graph")},
        "drafter_forwards": {m: d.get(f"drafter/{m}", 0.0) for m in ("cuda_graph", "eager")},
        "outputs": [o.token_ids for o in outs],
    }


def snapshot(llm: LLM) -> dict[str, float]:
    """The speculative-decoding and step counters, flattened to one key per (counter, label)."""
    out: dict[str, float] = {}
    names = {"tandem:spec_decode_num_drafts_total": "drafts", "tandem:spec_decode_num_draft_tokens_total": "draft_tokens",
             "tandem:spec_decode_num_accepted_tokens_total": "accepted"}
    for metric in llm.engine.metrics.registry.collect():
        for s in metric.samples:
            lab, key = s.labels, None
            if s.name in names:
                for k in (names[s.name], f"{names[s.name]}/{lab['phase']}"):
                    out[k] = out.get(k, 0.0) + s.value
                continue
            if s.name == "tandem:spec_decode_num_accepted_tokens_per_pos_total":
                for k in (f"pos{lab['position']}", f"pos{lab['position']}/{lab['phase']}"):
                    out[k] = out.get(k, 0.0) + s.value
                continue
            if s.name == "tandem:spec_decode_k_total":
                key = f"k/{lab['phase']}={lab['k']}"
            elif s.name == "tandem:model_steps_total":
                key = f"steps/{lab['mode']}"
            elif s.name == "tandem:spec_decode_drafter_steps_total":
                key = f"drafter/{lab['mode']}"
            if key is not None:
                out[key] = out.get(key, 0.0) + s.value
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--n", type=int, default=3, help="held-out prompts per task family")
    ap.add_argument("--methods", default="dspark,draft_model", help="comma-separated: ngram, draft_model, dspark")
    ap.add_argument("--ks", default="1,2,3,4")
    ap.add_argument("--phase-k", default='{"reasoning": 4, "content": 2, "tool_call": 2}',
                    help="phase_k of the adaptive runs (JSON)")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    ids = prompts(args.n)
    specs: list[dict | None] = [None]
    ks = [int(k) for k in args.ks.split(",")]
    phase_k = json.loads(args.phase_k)
    for method in args.methods.split(","):
        specs += [{"method": method, "num_speculative_tokens": k} for k in ks]
        specs.append({"method": method, "num_speculative_tokens": max(max(ks), *phase_k.values()),
                      "adaptive": "phase", "phase_k": phase_k})
    # Process warm-up, not measured: JIT, allocator, and the GPU's clocks (an idle H200 sits at a few
    # hundred MHz; a short warm-up left the first baseline at a third of the last one).
    for _ in range(2):
        run(args.device, None, 1, ids, args.max_tokens)
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
