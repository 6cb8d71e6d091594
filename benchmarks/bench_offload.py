"""End-to-end decode with routed experts in RAM on the CPU, on random weights of a real shape.

In one run: the machine's RAM read / GPU / PCIe constants (`tandem plan --measure`'s), the
placement `tandem serve` would choose for a GPU budget (default 8 GiB), then per batch size:
  * decode tok/s of the engine (CPU experts as host nodes inside the captured decode graphs),
  * the CPU kernel alone on one offloaded layer at that batch (random routing, cold weights),
  * the GPU side alone: the same engine with the offloaded layers' experts replaced by a zero
    executor (same graphs, no CPU work), and with the copies and host nodes but nothing computed
    (what each offloaded layer costs beyond its kernel),
  * the prediction  t_gpu_side + n_offloaded_layers x t_kernel  and how far the real step is off
    (the copies, host-node latency and waits that overlap does not hide),
  * the RAM roofline: routed-expert bytes a step reads (distinct experts x bytes per expert x
    offloaded layers) / measured read bandwidth, and the share of it the step reaches. The
    bandwidth is probed right before and right after each timed decode (`cpu_experts.ReadProbe`,
    the kernel's pool, with the experts in RAM) and the share is against the better of the two:
    on the device machine the read rate swings within a run (89-115 GB/s in one session), and the
    one probe at the start (`tandem plan --measure`'s, kept as `roofline_share_vs_start`) can
    flatter a step or wrong it.

    python benchmarks/bench_offload.py --out offload.json                   # Qwen3-30B-A3B, 8 GiB GPU
    python benchmarks/bench_offload.py --shape tiny --device cpu --batches 1,2   # CPU smoke run
    python benchmarks/bench_offload.py --handoff hostfunc,poll   # A/B of --cpu-moe-handoff, one process

Random weights route tokens about uniformly, so a batch touches about as many distinct experts as
uniform routing predicts; real checkpoints route less evenly (fewer distinct experts).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gpu import SHAPES, materialize_random, model_dir, run_decode  # noqa: E402

from tandem.config import CacheConfig, EngineConfig, ModelConfig, OffloadConfig, RunnerConfig, SchedulerConfig  # noqa: E402
from tandem.engine.engine import LLMEngine  # noqa: E402
from tandem.models.loader import build_meta_model  # noqa: E402
from tandem.models.registry import get_model_class  # noqa: E402
from tandem.offload import cpu_experts  # noqa: E402
from tandem.offload.cpu_executor import CpuMoEExecutor, OffloadedExperts  # noqa: E402
from tandem.offload.handoff import HANDOFFS, Doorbell  # noqa: E402
from tandem.offload.placement import expert_bytes  # noqa: E402
from tandem.offload.planner import plan_memory  # noqa: E402

GB = 1e9
DISTINCT_SETS = 8  # random experts generated per layer shape, cycled over the experts (packing is per expert)


def build_offloaded_model(cfg: dict, path: Path, placement, device: str, dtype: torch.dtype, threads: int | None,
                          staging_rows: int, offload: OffloadConfig | None = None):
    """The model on `device` with random weights; the placement's experts in RAM, random too
    (`offload`: the --cpu-moe-* options the experts are built with, e.g. the activation mode)."""
    model = build_meta_model(get_model_class(cfg["model_type"]), cfg, dtype, path / "config.json")
    sink = OffloadedExperts(placement, threads, staging_rows=staging_rows, offload=offload)
    sink.prepare(model)
    model = materialize_random(model, device)
    h, i = cfg["hidden_size"], cfg["moe_intermediate_size"]
    g = torch.Generator().manual_seed(1)
    mxfp4 = placement.cpu_format == "mxfp4"
    sets = [random_mxfp4(h, i, g) if mxfp4 else
            tuple((torch.randn(*shape, generator=g) * 0.02).to(dtype) for shape in ((i, h), (i, h), (h, i)))
            for _ in range(DISTINCT_SETS)]
    start = time.perf_counter()
    first = None
    for n, (layer, packed) in enumerate(sink.layers.items()):
        if first is None:  # pack one layer; the others get copies of its bytes (packing is ~3 ms an expert)
            for e in range(packed.num_experts):
                if mxfp4:
                    packed.set_expert_mxfp4(e, *sets[e % DISTINCT_SETS])
                else:
                    packed.set_expert(e, *sets[e % DISTINCT_SETS])
            first = packed
        else:
            packed.data.copy_(first.data)
        print(f"  filled layer {layer} ({n + 1}/{len(sink.layers)}, {time.perf_counter() - start:.0f} s)",
              end="\r", flush=True)
    print()
    sink.install(model, torch.device(device), dtype)
    return model, sink


def random_mxfp4(h: int, i: int, g: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(codes, scales) of gate, up [I, H] and down [H, I]: random FP4 codes, E8M0 scales near 2^-7
    (weights of about 0.004..0.05, as a trained checkpoint's)."""
    def one(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        codes = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=g)
        scales = torch.randint(118, 122, (rows, cols // 32), dtype=torch.uint8, generator=g)
        return codes, scales

    return [one(i, h), one(i, h), one(h, i)]


def kernel_ms(sink: OffloadedExperts, batch: int, top_k: int, dtype: torch.dtype, iters: int = 30) -> dict:
    """The CPU kernel alone: ms of one layer call at `batch` tokens (median, mean and p90 of
    `iters`), cycling over the offloaded layers so weights come from RAM, not cache; and the
    distinct experts per call. A decode step sums its layers' calls, so the mean is what it adds
    up to; the median (the ledger's figure since session 7) leaves out a slow tail."""
    layers = list(sink.layers.values())
    e, h = layers[0].num_experts, layers[0].hidden_size
    g = torch.Generator().manual_seed(batch)
    x = torch.randn(batch, h, generator=g).to(dtype)
    times, distinct = [], []
    for n in range(iters + len(layers)):
        ids = torch.stack([torch.randperm(e, generator=g)[:top_k] for _ in range(batch)])
        w = torch.softmax(torch.randn(batch, top_k, generator=g), -1).to(dtype)
        layer = layers[n % len(layers)]
        t = time.perf_counter()
        layer(x, ids, w)
        if n >= len(layers):  # the first pass over the layers warms the pool
            times.append(time.perf_counter() - t)
            distinct.append(len(set(ids.flatten().tolist())))
    ordered = sorted(times)
    return {"kernel_ms": statistics.median(times) * 1e3, "kernel_ms_mean": statistics.mean(times) * 1e3,
            "kernel_ms_p90": ordered[int(0.9 * (len(ordered) - 1))] * 1e3, "distinct_experts": statistics.mean(distinct)}


class ZeroExperts:
    """An executor that costs nothing: the GPU side of an offloaded layer alone."""

    def __call__(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(hidden)


def profile_gpu_side(engine: LLMEngine, batch: int, prompt: int, new_tokens: int, top: int = 20) -> dict:
    """One decode of the GPU side alone under torch.profiler: the summed GPU time of its kernels
    per decode step against the step's wall time (a GPU side far above its kernels is host- or
    launch-bound), the kernels launched a step, and the `top` kernels by GPU time."""
    from torch.profiler import ProfilerActivity, profile

    run_decode(engine, batch, prompt, 8, seed=700 + batch)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        r = run_decode(engine, batch, prompt, new_tokens, seed=800 + batch)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    steps = max(r["steps"], 1)
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name, []).append(e.time_range.elapsed_us())
    total_us = sum(sum(v) for v in by_name.values())
    out = {"batch": batch, "steps": r["steps"], "graph_steps": r["graph_steps"],
           "wall_ms_per_step": 1e3 * batch / r["decode_tok_s"], "gpu_kernel_ms_per_step": total_us / 1e3 / steps,
           "kernels_per_step": len(kernels) / steps,
           "top": [{"name": name[:90], "calls_per_step": len(v) / steps, "us_per_step": sum(v) / steps,
                    "us_per_call": sum(v) / len(v)}
                   for name, v in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]]}
    print(f"GPU side, batch {batch}, profiled: {out['wall_ms_per_step']:.2f} ms a step (wall, the profiler on), "
          f"kernels {out['gpu_kernel_ms_per_step']:.2f} ms a step, {out['kernels_per_step']:.0f} kernels a step", flush=True)
    for k in out["top"]:
        print(f"  {k['us_per_step']:8.1f} us/step {k['calls_per_step']:6.1f} calls/step {k['us_per_call']:7.2f} us/call  "
              f"{k['name']}", flush=True)
    return out


def make_engine(path: Path, model, device: str, dtype: torch.dtype, kv_bytes: int, max_num_seqs: int,
                max_len: int) -> LLMEngine:
    config = EngineConfig(
        model=ModelConfig(str(path), dtype, device, max_model_len=max_len),
        cache=CacheConfig(kv_cache_memory=kv_bytes, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max(512, max_num_seqs)),
        runner=RunnerConfig(),
    )
    return LLMEngine(config, model=model)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--gpu-budget", default="8GiB", help="GPU memory the placement plans for")
    ap.add_argument("--fmt", default="auto", help="--cpu-moe-dtype")
    ap.add_argument("--act-dtype", default="auto", help="--cpu-moe-act-dtype (int8: LOSSY int8 activations)")
    ap.add_argument("--threads", type=int, default=None, help="--cpu-moe-threads")
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--cpu-moe", action="store_true", help="every MoE layer's experts in RAM (default: the "
                                                             "placement `tandem serve` picks for --gpu-budget)")
    ap.add_argument("--num-experts-kept", type=int, default=None,
                    help="experts per layer (fewer than the shape's, to fit RAM; bytes per token do not change)")
    ap.add_argument("--handoff", default="hostfunc",
                    help=f"--cpu-moe-handoff, or several ({','.join(HANDOFFS)}): each measured in turn (CUDA)")
    ap.add_argument("--steal", default="off", choices=("off", "on", "off,on"),
                    help="the CPU kernel's work stealing (cpu_experts.set_steal); off,on measures each hand-off both "
                         "ways, labelled <handoff>+steal")
    ap.add_argument("--host-wait", default="auto", choices=("auto", "spin", "asleep", "spin,asleep"),
                    help="how the engine's host thread waits for a step's tokens (LLMEngine.waits_asleep; auto: its "
                         "default); spin,asleep measures each hand-off both ways, labelled <handoff>+<wait>")
    ap.add_argument("--repeats", type=int, default=1,
                    help="measure the hand-offs this many times, interleaved; each figure is the median")
    ap.add_argument("--profile-gpu-side", action="store_true",
                    help="also profile the GPU side alone at the first batch size (torch.profiler): its kernels' "
                         "GPU time a step against the step's wall time, and the kernels that take the most")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    handoffs = args.handoff.split(",")
    if any(h not in HANDOFFS for h in handoffs) or (args.device != "cuda" and handoffs != ["hostfunc"]):
        raise SystemExit(f"--handoff takes {', '.join(HANDOFFS)} (on CUDA; a CPU run calls the kernel directly)")
    # What is measured in turn: (label, hand-off, work stealing, host wait: None is the engine's default)
    waits = [None] if args.host_wait == "auto" else args.host_wait.split(",")
    variants = [(h + ("+steal" if on else "") + (f"+{w}" if w else ""), h, on, w) for h in handoffs
                for on in {"off": (False,), "on": (True,), "off,on": (False, True)}[args.steal] for w in waits]
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from tandem.config import parse_size

    cfg = dict(SHAPES[args.shape])
    if args.num_experts_kept:
        cfg["num_experts"] = args.num_experts_kept
    device, dtype = args.device, (torch.bfloat16 if args.device == "cuda" else torch.float32)
    batches = [int(b) for b in args.batches.split(",")]
    results: dict = {"shape": args.shape, "gpu_budget": args.gpu_budget}
    if device == "cuda":
        from tandem.offload.measure import measure_machine

        machine = measure_machine("cuda", threads=args.threads)
        results["machine"] = machine.__dict__
        print("measured:", machine.describe(), flush=True)
        ram = machine.ram_read
    else:
        ram = cpu_experts.measure_read_bandwidth(256 << 20, threads=args.threads)
        results["machine"] = {"ram_read": ram}
    max_len = args.prompt + args.new_tokens + 64
    with model_dir(cfg) as path:
        offload = OffloadConfig(cpu_moe=device == "cpu" or args.cpu_moe, cpu_moe_dtype=args.fmt, cpu_moe_threads=args.threads,
                                cpu_moe_act_dtype=args.act_dtype)
        plan = plan_memory(path, dtype, device, max_model_len=max_len, max_num_seqs=max(batches),
                           device_bytes=parse_size(args.gpu_budget) if device == "cuda" else None, offload=offload)
        print(plan.render(), flush=True)
        placement = plan.placement
        if not placement.offloaded or plan.offload_problems:
            raise SystemExit(f"nothing to measure: {placement.reason} {plan.offload_problems}")
        kv_bytes = max(plan.kv_budget, 64 << 20)
        model, sink = build_offloaded_model(cfg, path, placement, device, dtype, args.threads,
                                            staging_rows=max(512, max(batches)), offload=offload)
        per_expert = expert_bytes(placement.cpu_format, cfg["hidden_size"], cfg["moe_intermediate_size"])
        results.update(fmt=placement.cpu_format, act_dtype=args.act_dtype, cpu_layers=list(placement.cpu_layers), kernel_isa=cpu_experts.kernel_isa(),
                       threads=cpu_experts.num_threads(), bytes_per_expert=per_expert, placement=placement.reason)
        bells = {h: Doorbell() if h == "poll" else None for h in handoffs}
        probe = cpu_experts.ReadProbe(1 << 30, args.threads)
        zero_rows = torch.zeros(1, dtype=torch.int32, device=device)

        def use(handoff: str, steal: bool, rows: torch.Tensor | None = None) -> None:
            """CPU experts on every offloaded layer, handed off so (rows: the count the kernel is told)."""
            cpu_experts.set_steal(steal)
            if device == "cuda":
                for i, layer in sink.layers.items():
                    model.moe_blocks()[i].set_executor(CpuMoEExecutor(layer, sink.staging, rows=rows,
                                                                      doorbell=bells[handoff]))

        rows = [{"batch": b, "by_handoff": {}} for b in batches]
        runs: dict[tuple[int, str], list[dict]] = {}  # (batch, hand-off) -> one dict per repeat
        def engine_for(wait: str | None) -> LLMEngine:
            engine = make_engine(path, model, device, dtype, kv_bytes, max(batches), max_len)
            if wait is not None:
                engine.waits_asleep = wait == "asleep"
            return engine

        for n, (label, handoff, steal, wait) in enumerate(variants * args.repeats):
            use(handoff, steal)
            engine = engine_for(wait)
            for row in rows:
                b = row["batch"]
                run_decode(engine, b, args.prompt, 8, seed=100 + b)  # warm-up
                before = probe.measure()
                r = run_decode(engine, b, args.prompt, args.new_tokens, seed=200 + b)
                probes = [before, probe.measure()]
                if n == 0:
                    row.update(kernel_ms(sink, b, cfg["num_experts_per_tok"], dtype))
                step_ms = 1e3 * b / r["decode_tok_s"]
                cpu_bytes = row["distinct_experts"] * per_expert * len(sink.layers)
                got = {**r, "step_ms": step_ms, "ram_probes_gbps": [round(x / GB, 1) for x in probes],
                       "roofline_share": 1e3 * cpu_bytes / max(probes) / step_ms,
                       "roofline_share_vs_start": 1e3 * cpu_bytes / ram / step_ms}
                runs.setdefault((b, label), []).append(got)
                if n == 0:
                    row.update(expert_bytes_per_step=cpu_bytes, roofline_ms=1e3 * cpu_bytes / ram,
                               kernel_gbps=row["distinct_experts"] * per_expert / row["kernel_ms"] / 1e6)
                print(f"batch {b} ({label}): {r['decode_tok_s']:.2f} tok/s ({step_ms:.1f} ms a step, "
                      f"{r['graph_steps']} graph steps), kernel {row['kernel_ms']:.2f} ms a layer "
                      f"({row['kernel_gbps']:.1f} GB/s), RAM roofline share {got['roofline_share']:.0%} of the better of "
                      f"{probes[0] / GB:.1f} / {probes[1] / GB:.1f} GB/s probed around it "
                      f"({got['roofline_share_vs_start']:.0%} of the start's {ram / GB:.1f})", flush=True)
            del engine
            gc.collect()
            if device == "cuda":  # the copies and hand-offs with nothing computed: the offload's own cost
                torch.cuda.empty_cache()
                use(handoff, steal, rows=zero_rows)
                engine = engine_for(wait)
                for row in rows:
                    b = row["batch"]
                    run_decode(engine, b, args.prompt, 8, seed=500 + b)
                    runs[(b, label)][-1]["transfer_only_ms"] = 1e3 * b / run_decode(
                        engine, b, args.prompt, args.new_tokens, seed=600 + b)["decode_tok_s"]
                del engine
                gc.collect()
                torch.cuda.empty_cache()
        for bell in bells.values():
            if bell is not None:
                bell.check()
        for row in rows:  # per hand-off: the median of its repeats (by step time), and every step time
            for label, *_ in variants:
                got = sorted(runs[(row["batch"], label)], key=lambda g: g["step_ms"])
                row["by_handoff"][label] = {**got[(len(got) - 1) // 2], "step_ms_runs": [g["step_ms"] for g in got]}
                if "transfer_only_ms" in got[0]:
                    row["by_handoff"][label]["transfer_only_ms"] = statistics.median_low(
                        g["transfer_only_ms"] for g in got)
        for i in sink.layers:  # the GPU side alone, in the same graphs
            model.moe_blocks()[i].set_executor(ZeroExperts())
        engine = make_engine(path, model, device, dtype, kv_bytes, max(batches), max_len)
        for row in rows:
            b = row["batch"]
            run_decode(engine, b, args.prompt, 8, seed=300 + b)
            r = run_decode(engine, b, args.prompt, args.new_tokens, seed=400 + b)
            row["gpu_side_ms"] = 1e3 * b / r["decode_tok_s"]
            row["predicted_ms"] = row["gpu_side_ms"] + len(sink.layers) * row["kernel_ms"]
            row["predicted_from_mean_ms"] = row["gpu_side_ms"] + len(sink.layers) * row["kernel_ms_mean"]
            for handoff, got in row["by_handoff"].items():
                got["step_over_predicted"] = got["step_ms"] / row["predicted_ms"]
                got["step_over_predicted_from_mean"] = got["step_ms"] / row["predicted_from_mean_ms"]
                per_layer = ""
                if "transfer_only_ms" in got:
                    got["transfer_us_per_layer"] = 1e3 * (got["transfer_only_ms"] - row["gpu_side_ms"]) / len(sink.layers)
                    per_layer = f", copies + hand-off {got['transfer_us_per_layer']:.0f} us a layer"
                print(f"batch {b} ({handoff}): GPU side {row['gpu_side_ms']:.2f} ms, predicted {row['predicted_ms']:.1f} "
                      f"ms from the kernel's median call ({row['predicted_from_mean_ms']:.1f} from its mean; p90 call "
                      f"{row['kernel_ms_p90']:.2f} ms), measured {got['step_ms']:.1f} ms ({got['step_over_predicted']:.3f}x, "
                      f"{got['step_over_predicted_from_mean']:.3f}x){per_layer}", flush=True)
            row.update({k: v for k, v in row["by_handoff"][variants[0][0]].items() if k not in row})
        if args.profile_gpu_side and device == "cuda":
            results["gpu_side_profile"] = profile_gpu_side(engine, batches[0], args.prompt, args.new_tokens)
        results["decode"] = rows
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
