"""Prefill with every routed expert in RAM: the experts streamed over PCIe to the GPU
(tandem/offload/streaming.py) against the CPU experts, on the same weights in one process
(issue 17, part 1).

The model is DeepSeek-V4-Flash's expert shape (4096 hidden, 256 experts top-6 of 2048) on the
Qwen3-MoE architecture, `--layers` of them, random bf16 weights, every expert in RAM as bf16 (about
12.9 GB a layer) or as `--fmt` (mxfp4: 3.4 GB a layer). Reported: the cost model's threshold and what it was built from (PCIe and the
CPU kernel timed at start-up), prefill tok/s at each length with streaming, the bytes streamed and
the copy stream's bandwidth against the measured host-to-device limit, and the CPU-only prefill at
`--cpu-lengths`. Prompts are chunked at `--chunk` tokens (the scheduler's max_num_batched_tokens):
a chunk costs one pass of every layer's experts over PCIe whatever its length, so longer chunks
amortise it.

    python benchmarks/bench_stream_prefill.py --layers 4 --lengths 2048,8192,32768 --cpu-lengths 2048 --out s.json
    python benchmarks/bench_stream_prefill.py --shape tiny --device cpu --lengths 64,256 --cpu-lengths 64 --chunk 128
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gpu import SHAPES, model_dir, run_prefill  # noqa: E402
from bench_hot_experts import build  # noqa: E402

from tandem.config import CacheConfig, EngineConfig, ModelConfig, OffloadConfig, RunnerConfig, SchedulerConfig  # noqa: E402
from tandem.engine.engine import LLMEngine  # noqa: E402
from tandem.offload.measure import h2d_bandwidth  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=("v4-flash-experts", "qwen3-30b-a3b", "tiny"), default="v4-flash-experts")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--lengths", default="2048,8192,32768", help="prompt lengths prefilled with streaming")
    ap.add_argument("--cpu-lengths", default="2048", help="prompt lengths prefilled on the CPU experts too")
    ap.add_argument("--chunk", type=int, default=16384, help="max_num_batched_tokens: the prefill chunk")
    ap.add_argument("--reps", type=int, default=2, help="prefills per length (the best counts; the first warms up)")
    ap.add_argument("--fmt", default="auto", help="--cpu-moe-dtype of the experts in RAM (mxfp4: V4-Flash's own format, "
                                                  "a lossy conversion of the random bf16 weights here)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cfg = dict(SHAPES[args.shape], num_hidden_layers=args.layers)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    lengths = [int(x) for x in args.lengths.split(",") if x]
    cpu_lengths = [int(x) for x in args.cpu_lengths.split(",") if x]
    # On CUDA the threshold is the cost model's; a CPU smoke run streams through memory from 1 token.
    offload = OffloadConfig(cpu_moe=True, cpu_moe_threads=args.threads, cpu_moe_dtype=args.fmt,
                            stream_experts="auto" if args.device == "cuda" else "on")
    results: dict = {"shape": args.shape, "layers": args.layers, "chunk": args.chunk, "fmt": args.fmt, "runs": []}
    with model_dir(cfg) as path:
        model, sink, _ = build(cfg, path, args.device, dtype, offload, args.threads, args.chunk)
        streamer = sink.streamer
        assert streamer is not None, "no expert streamer was built (see the log)"
        threshold = streamer.min_tokens
        layer = next(iter(sink.layers.values()))
        results.update(threshold_tokens=threshold, experts_per_layer=layer.num_experts,
                       layer_expert_bytes=layer.nbytes, stream_group=streamer.group,
                       stream_device_bytes=streamer.device_bytes)
        if args.device == "cuda":
            results["h2d_bytes_per_s"] = h2d_bandwidth(torch.device("cuda"), 1 << 30)
            print(f"PCIe host->device {results['h2d_bytes_per_s'] / 1e9:.1f} GB/s (1 GiB pinned copy); cost model "
                  f"threshold {threshold} tokens", flush=True)
        config = EngineConfig(
            model=ModelConfig(str(path), dtype, args.device, max_model_len=max(lengths + cpu_lengths) + 64),
            cache=CacheConfig(kv_cache_memory=1 << 30, enable_prefix_caching=False),
            scheduler=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=args.chunk),
            runner=RunnerConfig(),
        )
        engine = LLMEngine(config, model=model)
        for length in lengths:
            streamer.reset_stats()
            seconds = run_prefill(engine, length, seed=length, reps=args.reps)["seconds"]
            stats = streamer.stats()  # both reps: bytes and copy-stream span add up over them
            run = {"path": "streamed" if length >= threshold else "cpu (below the threshold)", "length": length,
                   "prefill_tok_s": length / seconds, "seconds": seconds, "streamed_layer_calls": stats.layers,
                   "streamed_bytes": stats.bytes, "copy_seconds": stats.seconds, "copy_bytes_per_s": stats.bandwidth}
            if "h2d_bytes_per_s" in results and stats.seconds:
                run["copy_pct_of_h2d"] = 100 * stats.bandwidth / results["h2d_bytes_per_s"]
            results["runs"].append(run)
            print(f"prefill {length}: {run['prefill_tok_s']:.0f} tok/s ({run['path']}); streamed "
                  f"{stats.bytes / 1e9:.1f} GB in {stats.layers} layer calls at {stats.bandwidth / 1e9:.1f} GB/s",
                  flush=True)
        streamer.min_tokens = 1 << 40  # the CPU experts from here on, same weights and engine
        for length in cpu_lengths:
            seconds = run_prefill(engine, length, seed=length + 1, reps=args.reps)["seconds"]
            results["runs"].append({"path": "cpu (streaming off)", "length": length, "prefill_tok_s": length / seconds,
                                    "seconds": seconds})
            print(f"prefill {length} on the CPU experts: {length / seconds:.0f} tok/s", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
