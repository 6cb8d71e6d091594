"""What the lossy `--cpu-moe-dtype` conversions and `--cpu-moe-act-dtype int8` cost in quality, on
the trained demo model: task accuracy on held-out examples of each family (the demo's own
checkers) and agreement of the greedy tokens with the lossless run, with every routed expert on
the CPU kernel in each format. A format FMT/int8 runs FMT weights with int8 activations.

    python benchmarks/bench_cpu_moe_quality.py --n 40 --out cpu_moe_quality.json

fp32 on the CPU kernel is the reference: it gives the greedy tokens of the torch experts
(tests/test_cpu_offload.py checks that); bf16 rounds the weights as a bf16 checkpoint already is.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tandem import LLM  # noqa: E402
from tandem.builtin import DEMO_DIR  # noqa: E402
from tandem.demo import text  # noqa: E402
from tandem.demo.corpus import EVAL_SEED, FAMILIES, make_example  # noqa: E402
from tandem.demo.eval import generate_and_check  # noqa: E402


def agreement(a: list[int], b: list[int]) -> tuple[bool, int]:
    """(identical, tokens before the first difference)."""
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return a == b, n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default="fp32,bf16,int8,mxfp4,int4,mxfp4/int8,int4/int8",
                    help="comma list of weight formats, FMT/int8 for int8 activations with them")
    ap.add_argument("--n", type=int, default=40, help="held-out examples per family")
    ap.add_argument("--families", default=",".join(f for f in FAMILIES if f != "lookup"))
    ap.add_argument("--max-tokens", type=int, default=384)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    tok = text.load_tokenizer(DEMO_DIR / "tokenizer.json")
    families = args.families.split(",")
    examples = [make_example(EVAL_SEED, i, fam) for fam in families for i in range(args.n)]
    rows, reference = [], None
    for fmt in args.formats.split(","):
        start = time.perf_counter()
        weights, _, acts = fmt.partition("/")
        llm = LLM(str(DEMO_DIR), device="cpu", dtype="float32", kv_cache_memory="512MiB", max_model_len=4096,
                  max_num_seqs=64, cpu_moe=True, cpu_moe_dtype=weights, cpu_moe_act_dtype=acts or "auto")
        res = generate_and_check(llm, tok, examples, max_tokens=args.max_tokens)
        del llm
        outs = [r["output_ids"] for r in res]
        reference = reference or outs
        same = [agreement(o, r) for o, r in zip(outs, reference)]
        row = {"fmt": fmt, "accuracy": sum(r["ok"] for r in res) / len(res),
               "by_family": {f: sum(r["ok"] for r in res if r["family"] == f) / args.n for f in families},
               "identical_outputs": sum(s for s, _ in same) / len(same),
               "mean_tokens_before_divergence": sum(n for _, n in same) / len(same),
               "mean_output_tokens": sum(map(len, outs)) / len(outs), "seconds": time.perf_counter() - start}
        rows.append(row)
        print(f"{fmt:10} accuracy {row['accuracy']:.3f}  identical to {args.formats.split(',')[0]}: "
              f"{row['identical_outputs']:.0%}  tokens before divergence {row['mean_tokens_before_divergence']:.0f} "
              f"of {row['mean_output_tokens']:.0f}  {row['by_family']}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"n_per_family": args.n, "families": families, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
