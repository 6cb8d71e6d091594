"""Prefill with every routed expert in RAM: the experts streamed over PCIe to the GPU
(tandem/offload/streaming.py) against the CPU experts, on the same weights in one process
(issue 17, part 1).

The model is DeepSeek-V4-Flash's expert shape (4096 hidden, 256 experts top-6 of 2048) on the
Qwen3-MoE architecture, `--layers` of them, random bf16 weights, every expert in RAM as bf16 (about
12.9 GB a layer) or as `--fmt` (mxfp4: 3.4 GB a layer). Reported: the cost model's threshold and what it was built from (PCIe and the
CPU kernel timed at start-up), prefill tok/s at each length with streaming, the bytes streamed and
the copy stream's bandwidth against the measured host-to-device limit, and the CPU-only prefill at
`--cpu-lengths`. Prompts are chunked at `--chunk` tokens (the scheduler's max_num_batched_tokens;
`auto`, the default, is the engine's: the streaming cost model's chunk, logged and reported): a
chunk costs one pass of every layer's experts over PCIe whatever its length, so longer chunks
amortise it until the GPU's work fills the copy.

The stream gap (`tandem bench streamgap`'s question, in process: the device machine has no HTTP
stack): a request decodes; after 8 of its tokens a `--gap-prefill`-token prompt arrives and is
prefilled in chunks alongside it. Reported: the decoding request's inter-token gaps before the
intruder (median) and while it prefills (max), and the intruder's time to first token, with the
experts streamed and (for `--cpu-gap-prefill` tokens) on the CPU.

    python benchmarks/bench_stream_prefill.py --layers 4 --lengths 2048,8192,32768 --cpu-lengths 2048 --out s.json
    python benchmarks/bench_stream_prefill.py --shape tiny --device cpu --lengths 64,256 --cpu-lengths 64 --chunk 128
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gpu import SHAPES, model_dir, run_prefill  # noqa: E402
from bench_hot_experts import build  # noqa: E402

from tandem.config import (  # noqa: E402
    MAX_AUTO_CHUNK,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    OffloadConfig,
    RunnerConfig,
    SchedulerConfig,
)
from tandem.core import SamplingParams  # noqa: E402
from tandem.engine.engine import LLMEngine  # noqa: E402
from tandem.offload.measure import h2d_bandwidth  # noqa: E402


def stream_gap(engine: LLMEngine, intruder: int, decode_tokens: int = 48, after: int = 8) -> dict:
    """One request decodes `decode_tokens`; once it has `after` of them an `intruder`-token prompt
    arrives. Its inter-token gaps before the intruder and while the intruder prefills, and the
    intruder's time to first token (module docstring)."""
    g = torch.Generator().manual_seed(intruder)
    vocab = min(150000, engine.vocab_size)
    engine.add_request("gap-decode", torch.randint(0, vocab, (32,), generator=g).tolist(),
                       SamplingParams(max_tokens=decode_tokens, temperature=0.0, ignore_eos=True))
    times, sent, first = [], None, None  # when each decode token arrived; the intruder's send and first token
    while engine.has_unfinished:
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            if out.request_id == "gap-decode" and out.new_token_ids:
                times += [now] * len(out.new_token_ids)
            elif out.request_id == "gap-intruder" and out.new_token_ids and first is None:
                first = now
        if sent is None and len(times) >= after:
            engine.add_request("gap-intruder", torch.randint(0, vocab, (intruder,), generator=g).tolist(),
                               SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
            sent = time.perf_counter()
    gaps = [b - a for a, b in zip(times, times[1:])]
    before = sorted(gaps[: after - 1])
    during = [b - a for a, b in zip(times, times[1:]) if sent < b and (first is None or a < first)]
    return {"intruder_tokens": intruder, "itl_before_median_s": before[len(before) // 2] if before else None,
            "max_gap_during_s": max(during) if during else None, "decode_tokens_during": len(during),
            "intruder_ttft_s": first - sent if first is not None else None}


def describe_gap(gap: dict) -> str:
    ms = {k: (1e3 * v if v is not None else float("nan")) for k, v in gap.items() if k.endswith("_s")}
    return (f"decode ITL {ms['itl_before_median_s']:.1f} ms before, max gap {ms['max_gap_during_s']:.0f} ms over the "
            f"{gap['decode_tokens_during']} tokens during its prefill, intruder TTFT {ms['intruder_ttft_s']:.0f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=("v4-flash-experts", "qwen3-30b-a3b", "tiny"), default="v4-flash-experts")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--lengths", default="2048,8192,32768", help="prompt lengths prefilled with streaming")
    ap.add_argument("--cpu-lengths", default="2048", help="prompt lengths prefilled on the CPU experts too")
    ap.add_argument("--chunk", default="auto", help="max_num_batched_tokens: the prefill chunk (auto: the engine's)")
    ap.add_argument("--gap-prefill", type=int, default=8192, help="the intruder's prompt in the stream-gap run (0: none)")
    ap.add_argument("--cpu-gap-prefill", type=int, default=0, help="the same with the experts on the CPU (0: none)")
    ap.add_argument("--reps", type=int, default=2, help="prefills per length (the best counts; the first warms up)")
    ap.add_argument("--fmt", default="auto", help="--cpu-moe-dtype of the experts in RAM (mxfp4: V4-Flash's own format, "
                                                  "a lossy conversion of the random bf16 weights here)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the cost model's lines: threshold and chunk
    cfg = dict(SHAPES[args.shape], num_hidden_layers=args.layers)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    lengths = [int(x) for x in args.lengths.split(",") if x]
    cpu_lengths = [int(x) for x in args.cpu_lengths.split(",") if x]
    # On CUDA the threshold is the cost model's; a CPU smoke run streams through memory from 1 token.
    offload = OffloadConfig(cpu_moe=True, cpu_moe_threads=args.threads, cpu_moe_dtype=args.fmt,
                            stream_experts="auto" if args.device == "cuda" else "on")
    chunk = None if args.chunk == "auto" else int(args.chunk)
    results: dict = {"shape": args.shape, "layers": args.layers, "chunk_asked": args.chunk, "fmt": args.fmt, "runs": []}
    with model_dir(cfg) as path:
        model, sink, _ = build(cfg, path, args.device, dtype, offload, args.threads, chunk or MAX_AUTO_CHUNK)
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
            model=ModelConfig(str(path), dtype, args.device,
                              max_model_len=max(lengths + cpu_lengths + [args.gap_prefill, args.cpu_gap_prefill]) + 64),
            cache=CacheConfig(kv_cache_memory=1 << 30, enable_prefix_caching=False),
            scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=chunk),
            runner=RunnerConfig(),
        )
        engine = LLMEngine(config, model=model)
        results["chunk"] = engine.config.scheduler.max_num_batched_tokens
        print(f"prefill chunk {results['chunk']} tokens ({'auto' if chunk is None else '--chunk'})",
              flush=True)
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
        if args.gap_prefill:
            results["gap_streamed"] = stream_gap(engine, args.gap_prefill)
            print(f"stream gap, {args.gap_prefill}-token intruder (streamed): {describe_gap(results['gap_streamed'])}",
                  flush=True)
        if args.device == "cuda":
            results["peak_gpu_bytes"] = torch.cuda.max_memory_allocated()
            print(f"peak GPU memory allocated {results['peak_gpu_bytes'] / 2**30:.2f} GiB", flush=True)
        streamer.min_tokens = 1 << 40  # the CPU experts from here on, same weights and engine
        if args.cpu_gap_prefill:
            results["gap_cpu"] = stream_gap(engine, args.cpu_gap_prefill)
            print(f"stream gap, {args.cpu_gap_prefill}-token intruder (CPU experts): {describe_gap(results['gap_cpu'])}",
                  flush=True)
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
