"""What a speculative engine that drafts nothing costs the host, on the CPU: a tiny dense target
(one layer, hidden 64, written by the tests' tiny_models; its steps are host-bound, as the demo
model's are on the H100 box at 4-16 requests) against the same engine with a draft model of other
random weights under `adaptive: "auto"`. The draft is never accepted, so auto keeps K = 0 (probes
aside) and both engines run the same number of steps: the difference in tok/s is the speculative
stage's host time.

    python benchmarks/bench_k0_host.py --concurrency 4,16 --rounds 6
    python benchmarks/bench_k0_host.py --ab-held   # also the engine with held steps counted and timed every step
    python benchmarks/bench_k0_host.py --padded    # auto's cost model padded, as on a GPU

Each round runs every configuration once (in an order that alternates), the first round is a
warm-up, and the figures are medians over the others. CPU-only: the device machine's figures come
from `bench_auto.py` (its draft_model auto rows).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import tandem.engine.engine as engine_module  # noqa: E402
from bench_auto import run_level  # noqa: E402
from tandem import LLM  # noqa: E402
from tiny_models import save_tiny_model  # noqa: E402


def held_mode(every_step: bool) -> None:
    """The engine's handling of a held K choice: every step counted and timed (the old way), or
    its defaults (repeats counted once per run, one step in HELD_STEPS_TIMED timed)."""
    engine_module.HELD_STEPS_TIMED, engine_module.MAX_HELD_UNCOUNTED = (1, 0) if every_step else DEFAULTS


DEFAULTS = (engine_module.HELD_STEPS_TIMED, engine_module.MAX_HELD_UNCOUNTED)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", default="4,16")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--ab-held", action="store_true", help="also run auto with held steps counted and timed every step")
    ap.add_argument("--padded", action="store_true",
                    help="auto's cost model padded, as with CUDA graphs (its searches and holds as on a GPU)")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="tandem-k0-"))
    save_tiny_model(root / "target", "qwen3", seed=1, num_hidden_layers=1)
    save_tiny_model(root / "draft", "qwen3", seed=7, num_hidden_layers=1)
    rng = random.Random(0)
    prompts = [[rng.randrange(5, 200) for _ in range(8)] for _ in range(args.prompts)]
    kw = dict(device="cpu", max_num_seqs=max(int(c) for c in args.concurrency.split(",")), kv_cache_memory="256MiB",
              async_scheduling=True)
    spec = {"method": "draft_model", "model": str(root / "draft"), "num_speculative_tokens": 4, "adaptive": "auto"}
    llms = {"none": LLM(str(root / "target"), **kw), "draft_model auto": LLM(str(root / "target"), speculative_config=spec, **kw)}
    if args.padded:  # the CPU runs ragged steps; the tables stay, the search and the holds become a GPU's
        llms["draft_model auto"].engine.spec.auto.cost.padded = True
    configs = [("none", False), ("draft_model auto", False)] + ([("draft_model auto, every step", True)] if args.ab_held else [])
    print(f"{'config':<32}" + "".join(f"{'conc ' + c:>20}" for c in args.concurrency.split(",")))
    table: dict[str, str] = {name: "" for name, _ in configs}
    for conc in (int(c) for c in args.concurrency.split(",")):
        results: dict[str, list[float]] = {name: [] for name, _ in configs}
        for r in range(args.rounds):
            order = configs if r % 2 else configs[::-1]
            for name, every_step in order:
                held_mode(every_step)
                tokens, seconds = run_level(llms[name.split(",")[0]], prompts, conc, args.max_tokens)
                results[name].append(tokens / seconds)
        held_mode(False)
        base = statistics.median(results["none"][1:])
        for name, values in results.items():
            med = statistics.median(values[1:])
            table[name] += f"{med:12.0f} ({med / base:5.3f}x)"
    for name, row in table.items():
        print(f"{name:<32}{row}")


if __name__ == "__main__":
    main()
