"""Where batch-1 decode time goes on the GPU: the whole engine step against the captured graph's
replay alone (GPU time), on the Qwen3-30B-A3B shape of bench_gpu.py.

    python benchmarks/profile_decode.py [--layers 48] [--tokens 128]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gpu import QWEN3_30B_A3B, build_engine  # noqa: E402

from tandem.builtin import TOKENIZER_ASSET  # noqa: E402
from tandem.core import SamplingParams  # noqa: E402


def decode_step_times(engine, prompt: int, tokens: int) -> list[float]:
    """Seconds of each decode step of one greedy request (a `prompt`-token prompt, `tokens` new
    tokens), after a warm-up request: the time between one `step` call's start and the next's, so
    with async scheduling (a step launched before the last one's tokens land) it is the steady
    period, not the host's share alone."""
    engine.add_request("warm", list(range(100, 100 + prompt)), SamplingParams(max_tokens=8, temperature=0.0,
                                                                             ignore_eos=True))
    while engine.has_unfinished:
        engine.step()
    engine.add_request("p", list(range(1000, 1000 + prompt)), SamplingParams(max_tokens=tokens, temperature=0.0,
                                                                            ignore_eos=True))
    engine.step()  # prefill
    step_times = []
    torch.cuda.synchronize()
    t = time.perf_counter()
    while engine.has_unfinished:
        engine.step()
        now = time.perf_counter()
        step_times.append(now - t)
        t = now
    return step_times


def profile_graph(engine, key: tuple[int, int], step_times: list[float], rows: int = 15) -> tuple[dict, str]:
    """The captured graph `key`'s GPU time per replay against the median engine step of
    `step_times` (the difference is host work), and its kernels by GPU time (one replay, torch
    profiler)."""
    from torch.profiler import ProfilerActivity, profile

    step_ms = 1e3 * sorted(step_times)[len(step_times) // 2]
    graph = engine.runner.graphs[key].graph
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(5):
        graph.replay()
    start.record()
    for _ in range(50):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    replay_ms = start.elapsed_time(end) / 50
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows)
    return ({"median_step_ms": step_ms, "graph_replay_gpu_ms": replay_ms, "host_overhead_ms": step_ms - replay_ms,
             "tok_s": 1e3 / step_ms, "tok_s_if_no_host_overhead": 1e3 / replay_ms}, table)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cfg = dict(QWEN3_30B_A3B, num_hidden_layers=args.layers)
    model_dir = Path(tempfile.mkdtemp(prefix="tandem-prof-"))
    (model_dir / "config.json").write_text(json.dumps(cfg))
    shutil.copy(TOKENIZER_ASSET, model_dir / "tokenizer.json")
    engine = build_engine(cfg, model_dir, 1, 2048, 4.0, enforce_eager=False)
    step_times = decode_step_times(engine, 512, args.tokens)
    result, table = profile_graph(engine, (1, 1), step_times)
    print(json.dumps(result, indent=2))
    print(table)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n" + table)
    shutil.rmtree(model_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
