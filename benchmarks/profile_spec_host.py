"""Where a speculative step's wall time goes on the host: the demo pair (at concurrency 1, or
`--concurrency`) on the bench_auto workload, one configuration per process, under cProfile (engine steps only, after a
warm-up), with the wall time per step and the device's share measured around it.

    python benchmarks/profile_spec_host.py --device cuda --spec '{"method": "dspark", "num_speculative_tokens": 4}'
    python benchmarks/profile_spec_host.py --device cuda --spec '...' --async-scheduling off   # the synchronous steps
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_auto import workload  # noqa: E402

from tandem import LLM, SamplingParams  # noqa: E402
from tandem.builtin import demo_model_dir  # noqa: E402


KINDS: dict[str, list[float]] = {}  # engine steps by kind: [count, seconds] (see run)


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams, concurrency: int = 1) -> tuple[int, int, float]:
    """(tokens, engine steps, seconds) of the prompts, `concurrency` at a time (a finished one's
    place taken by the next); each step's seconds go to KINDS by whether it ran a prefill forward
    ("prefill") or not ("decode")."""
    eng = llm.engine
    tokens = steps = 0
    execute, prefilled = eng.runner.execute, [False]

    def traced(batch, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        out = execute(batch, *args, **kwargs)
        prefilled[0] |= out.mode in ("prefill", "prefill_graph")
        return out

    eng.runner.execute = traced
    start = time.perf_counter()
    queue = list(enumerate(prompts))
    while queue or eng.has_unfinished:
        while queue and eng.num_unfinished < concurrency:
            i, p = queue.pop(0)
            eng.add_request(f"p{i}-{time.monotonic_ns()}", p, params)
        if eng.has_unfinished:
            steps += 1
            prefilled[0] = False
            at = time.perf_counter()
            tokens += sum(len(o.new_token_ids) for o in eng.step())
            kind = KINDS.setdefault("prefill" if prefilled[0] else "decode", [0, 0.0])
            kind[0] += 1
            kind[1] += time.perf_counter() - at
    eng.runner.execute = execute
    return tokens, steps, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--spec", default=None, help="--speculative-config JSON (default: none)")
    ap.add_argument("--async-scheduling", choices=("on", "off"), default="on")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=1, help="requests kept in flight (at most 16)")
    ap.add_argument("--prefill-graph-max-tokens", type=int, default=512, help="0: prefill runs eagerly")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--top", type=int, default=35)
    ap.add_argument("--torch-profile", type=int, default=0, metavar="N", help="also profile N prompts with torch.profiler")
    ap.add_argument("--profile-max-tokens", type=int, default=None,
                    help="max_tokens of the torch-profiled prompts (e.g. 2: mostly their prefill)")
    ap.add_argument("--chrome-trace", type=Path, default=None, help="write the torch profile's trace here")
    args = ap.parse_args()
    llm = LLM(str(demo_model_dir()), device=args.device, kv_cache_memory="1GiB", max_num_seqs=16,
              speculative_config=json.loads(args.spec) if args.spec else None,
              async_scheduling=args.async_scheduling == "on", prefill_graph_max_tokens=args.prefill_graph_max_tokens)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    prompts = workload(args.prompts)
    run(llm, prompts, params, args.concurrency)  # warm-up: every prompt length's kernels compiled
    prof = cProfile.Profile()
    prof.enable()
    tokens, steps, seconds = run(llm, prompts, params, args.concurrency)
    prof.disable()
    print(f"spec {args.spec} async {args.async_scheduling} prefill graphs <= {args.prefill_graph_max_tokens}, "
          f"concurrency {args.concurrency}: {tokens} tokens in {steps} steps, {seconds:.3f} s "
          f"(under cProfile): {tokens / seconds:.0f} tok/s, {1e3 * seconds / steps:.3f} ms a step; "
          f"steps ahead {llm.engine.num_async_steps}")
    pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)
    pstats.Stats(prof).sort_stats("cumulative").print_stats("tandem", args.top)  # Tandem's own, inclusive
    KINDS.clear()
    tokens, steps, seconds = run(llm, prompts, params, args.concurrency)
    by_kind = ", ".join(f"{k} {n} steps {1e3 * t / n:.2f} ms each" for k, (n, t) in sorted(KINDS.items()))
    print(f"without cProfile: {tokens / seconds:.0f} tok/s, {1e3 * seconds / steps:.3f} ms a step ({by_kind})")
    if args.torch_profile:  # the host's torch and CUDA API calls (blocking ones stand out), and the device's kernels
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
        short = SamplingParams(max_tokens=args.profile_max_tokens or args.max_tokens, temperature=0.0)
        KINDS.clear()
        with profile(activities=activities) as torch_prof:
            tokens, steps, seconds = run(llm, prompts[: args.torch_profile], short)
        by_kind = ", ".join(f"{k} {n} steps {1e3 * t / n:.2f} ms each" for k, (n, t) in sorted(KINDS.items()))
        print(f"torch-profiled: {args.torch_profile} prompts, max_tokens {short.max_tokens}: {tokens} tokens, "
              f"{steps} steps, {1e3 * seconds:.1f} ms ({by_kind})")
        table = torch_prof.key_averages()
        print(table.table(sort_by="self_cpu_time_total", row_limit=args.top))
        if args.device == "cuda":
            print(table.table(sort_by="self_cuda_time_total", row_limit=args.top))
        if args.chrome_trace is not None:
            torch_prof.export_chrome_trace(str(args.chrome_trace))


if __name__ == "__main__":
    main()
