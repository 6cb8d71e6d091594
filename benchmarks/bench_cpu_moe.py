"""The CPU routed-expert kernel (tandem/offload/cpu_experts.py) at decode / verify batch sizes,
against the machine's RAM read bandwidth and against torch's own CPU paths on the same shapes.

Per shape, format and batch: random routing with the shape's top-k over the kept experts, weights
cold (several layers cycled per call, their experts together far larger than the L3), the median
time of one layer call (`HostJob.run()`, the path a CUDA host node takes), the distinct experts a
call touched, bytes = distinct x bytes per expert, GB/s and its share of the measured read
bandwidth. The roofline is read again between calls (`--probe-every`: a read of the probe's buffer,
the best of 3, every N calls; each row's RAM figure and share are against the median of the
readings taken among its calls, and the rows give their spread): on a shared host the read
bandwidth swings within a run, and a single probe taken before the calls can sit on a peak or a
dip. Baselines: a per-expert torch bf16 loop (F.linear per expert hit) and torch's
`_weight_int4pack_mm_for_cpu` (int4, groups of 32) where this torch has it.

    python benchmarks/bench_cpu_moe.py --shape both --fmt bf16,mxfp4,int4 --batches 1,2,4,8 --out results.json
    python benchmarks/bench_cpu_moe.py --quick          # a small shape, seconds
    python benchmarks/bench_cpu_moe.py --shape v4-flash --fmt mxfp4 --act-dtype auto,int8   # int8 activations A/B
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tandem.offload import cpu_experts as ce  # noqa: E402

GiB = 1 << 30


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    inter: int
    experts: int
    top_k: int


SHAPES = {
    "qwen3-30b": Shape("qwen3-30b", 2048, 768, 128, 8),
    "v4-flash": Shape("v4-flash", 4096, 2048, 256, 6),
}
QUICK = Shape("quick", 1024, 512, 32, 4)
SEEDS = 4  # distinct experts generated per format; the others are copies (DRAM does not dedupe)


def available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def cpu_name() -> str:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.machine()


def plan_layers(layer_bytes: int, args: argparse.Namespace) -> int:
    """Layers to cycle: enough for a cold working set (>= args.working_set), within the budget."""
    want = args.layers or max(2, min(8, math.ceil(args.working_set / layer_bytes)))
    return min(want, int(args.budget // layer_bytes))


def routing(shape: Shape, kept: int, batch: int, calls: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k = min(shape.top_k, kept)
    ids = torch.rand(calls, batch, kept, generator=g).topk(k, dim=-1).indices  # [C, T, k] distinct per token
    w = torch.rand(calls, batch, k, generator=g)
    return ids, w / w.sum(-1, keepdim=True)


def seed_layer(shape: Shape, fmt: str) -> ce.CpuExpertLayer:
    """SEEDS random experts packed in `fmt` (mxfp4: random codes, scales in a narrow range)."""
    h, i = shape.hidden, shape.inter
    layer = ce.CpuExpertLayer.empty(SEEDS, h, i, fmt)
    g = torch.Generator().manual_seed(0)
    for e in range(SEEDS):
        if fmt == "mxfp4":
            def part(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
                return (torch.randint(0, 256, (rows, cols // 2), generator=g, dtype=torch.uint8),
                        torch.randint(118, 123, (rows, cols // 32), generator=g, dtype=torch.uint8))
            layer.set_expert_mxfp4(e, part(i, h), part(i, h), part(h, i))
        else:
            layer.set_expert(e, torch.randn(i, h, generator=g) / h**0.5, torch.randn(i, h, generator=g) / h**0.5,
                             torch.randn(h, i, generator=g) / i**0.5)
    return layer


def copies(seeds: list[torch.Tensor], kept: int) -> list[torch.Tensor]:
    """Each seed tensor [SEEDS, ...] -> [kept, ...] in fresh memory."""
    out = []
    for s in seeds:
        t = torch.empty((kept, *s.shape[1:]), dtype=s.dtype)
        for j in range(kept):
            t[j].copy_(s[j % SEEDS])
        out.append(t)
    return out


def seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def row(shape: Shape, impl: str, batch: int, seconds: float, ids: torch.Tensor, bytes_per_expert: int,
        readings: list[float]) -> dict:
    """One implementation at one batch: `readings`, the read bandwidth probed among its calls."""
    distinct = statistics.mean(len(c.unique()) for c in ids)
    nbytes = distinct * bytes_per_expert
    bandwidth = statistics.median(readings)
    return {"shape": shape.name, "impl": impl, "batch": batch, "median_us": seconds * 1e6, "distinct": distinct,
            "mb_per_call": nbytes / 1e6, "gbps": nbytes / seconds / 1e9, "ram_gbps": bandwidth / 1e9,
            "ram_gbps_min": min(readings) / 1e9, "ram_gbps_max": max(readings) / 1e9, "probes": len(readings),
            "share": nbytes / seconds / bandwidth}


def probe_due(args: argparse.Namespace, call: int, readings: list[float]) -> None:
    """Read the roofline before call `call` when one is due (the first call, then every
    `--probe-every`), with the weights built and the calls' memory traffic around it."""
    if call == 0 or (args.probe_every and call % args.probe_every == 0):
        readings.append(args.probe.measure(3))


def bench_tandem(shape: Shape, fmt: str, kept: int, args: argparse.Namespace) -> list[dict]:
    seed = seed_layer(shape, fmt)
    layer_bytes = kept * seed.bytes_per_expert
    n_layers = plan_layers(layer_bytes, args)
    if n_layers < 1:
        print(f"  skip tandem-{fmt}: one layer needs {layer_bytes / GiB:.1f} GiB, budget {args.budget / GiB:.1f} GiB")
        return []
    layers = []
    for _ in range(n_layers):
        layer = ce.CpuExpertLayer.empty(kept, shape.hidden, shape.inter, fmt)
        for j in range(kept):
            layer.data[j].copy_(seed.data[j % SEEDS])
        layers.append(layer)
    acts = [a for a in args.acts if a == "auto" or fmt in ce.INT8_ACT_FORMATS]
    if len(acts) < len(args.acts):
        print(f"  tandem-{fmt}: no int8 activations for {fmt} weights (only {', '.join(ce.INT8_ACT_FORMATS)})")
    print(f"  tandem-{fmt}: {n_layers} layers x {layer_bytes / GiB:.2f} GiB, {ce.kernel_isa()}, {ce.num_threads()} threads")
    rows = []
    for batch in args.batches:
        ids, w = routing(shape, kept, batch, args.calls + args.warmup, seed=batch)
        x = torch.randn(batch, shape.hidden).bfloat16()
        out = torch.empty_like(x)
        stage_ids, stage_w = torch.empty_like(ids[0]), torch.empty_like(w[0]).bfloat16()
        count = torch.tensor([batch], dtype=torch.int32)
        jobs = {act: [ce.CpuExpertLayer(layer.data, kept, shape.hidden, shape.inter, fmt, act_dtype=act)
                      .host_job(x, stage_ids, stage_w, out, count) for layer in layers] for act in acts}
        # Settings A/B (ISAs x prefetch distances x activation modes): each call runs under every
        # setting in turn (the layer after the one timed last, so each still starts cold), so that
        # drift weighs on all of them alike.
        settings = [(isa, pf, act, dyn) for isa in args.isas for pf in args.prefetch for act in acts
                    for dyn in args.dynamic]
        times: dict[tuple, list[float]] = {st: [] for st in settings}
        profiles: dict[tuple, list[ce.CallProfile]] = {st: [] for st in settings}
        ce.set_profile(args.profile)
        at, readings = 0, []
        for c in range(args.warmup + args.calls):
            probe_due(args, c, readings)
            for isa, pf, act, dyn in settings:
                if isa is not None:
                    ce.set_isa(isa)
                if pf is not None:
                    ce.set_prefetch(*pf)
                if dyn == "steal":
                    ce.set_steal(True)
                elif dyn is not None:
                    ce.set_steal(False)
                    ce.set_balance(dyn)
                stage_ids.copy_(ids[c]), stage_w.copy_(w[c])  # untimed, as the D2H copy would be
                times[(isa, pf, act, dyn)].append(seconds(jobs[act][at % n_layers].run))
                if args.profile:
                    profiles[(isa, pf, act, dyn)].append(ce.read_profile())
                at += 1
        ce.set_profile(False)
        for (isa, pf, act, dyn), ts in times.items():
            impl = (f"tandem-{fmt}" + ("" if isa is None or len(args.isas) == 1 else f" {isa}")
                    + ("" if pf is None else f" pf{pf[0]}/{pf[1]}")
                    + ("" if dyn is None else " steal" if dyn == "steal" else f" dyn{dyn}")
                    + ("" if act == "auto" else f" {act}-act"))
            median = statistics.median(ts[args.warmup:])
            rows.append(row(shape, impl, batch, median, ids[args.warmup:], seed.bytes_per_expert, readings)
                        | {"act_dtype": act} | profile_summary(impl, batch, profiles[(isa, pf, act, dyn)][args.warmup:]))
    return rows


def profile_summary(impl: str, batch: int, profiles: list[ce.CallProfile]) -> dict:
    """--profile: per part of a call, the mean over calls of the threads' mean and max (ms), printed
    as one line; {} without a profile."""
    if not profiles:
        return {}
    parts = {part: [statistics.mean(p.per_call_ms(part)[j] for p in profiles) for j in (0, 1)]
             for part in ce.PROFILE_PARTS}
    call_ms = 1e3 * statistics.mean(p.call_seconds / max(p.calls, 1) for p in profiles)
    route_ms = 1e3 * statistics.mean(p.route_seconds / max(p.calls, 1) for p in profiles)
    print(f"  profile {impl} batch {batch}: call {call_ms:.3f} ms, route {route_ms:.3f}; per part mean / max "
          "over threads: " + ", ".join(f"{part} {m:.3f}/{x:.3f}" for part, (m, x) in parts.items()))
    return {"profile_ms": parts, "call_ms": call_ms, "route_ms": route_ms}


def torch_bf16_loop(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                    down: torch.Tensor) -> torch.Tensor:
    """A per-expert torch loop (what tandem's "torch" executor does), bf16 weights."""
    out = torch.zeros_like(x)
    for e in ids.unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        h = x[tok]
        y = F.linear(F.silu(F.linear(h, gate[e])) * F.linear(h, up[e]), down[e])
        out.index_add_(0, tok, y * w[tok, slot, None].to(x.dtype))
    return out


def bench_torch_bf16(shape: Shape, kept: int, args: argparse.Namespace) -> list[dict]:
    h, i = shape.hidden, shape.inter
    per_expert = 3 * h * i * 2
    n_layers = plan_layers(kept * per_expert, args)
    if n_layers < 1:
        print(f"  skip torch-bf16-loop: one layer needs {kept * per_expert / GiB:.1f} GiB")
        return []
    g = torch.Generator().manual_seed(1)
    seeds = [torch.randn(SEEDS, i, h, generator=g).bfloat16(), torch.randn(SEEDS, i, h, generator=g).bfloat16(),
             torch.randn(SEEDS, h, i, generator=g).bfloat16()]
    layers = [copies(seeds, kept) for _ in range(n_layers)]
    print(f"  torch-bf16-loop: {n_layers} layers, {torch.get_num_threads()} torch threads")
    return time_torch(shape, "torch-bf16-loop", torch_bf16_loop, layers, kept, per_expert, args)


def time_torch(shape: Shape, impl: str, forward: Callable[..., torch.Tensor], layers: list, kept: int,
               per_expert: int, args: argparse.Namespace) -> list[dict]:
    """A torch baseline's rows: `forward(x, ids, w, *layer)` per batch, cycling over `layers`."""
    rows = []
    for batch in args.batches:
        ids, w = routing(shape, kept, batch, args.calls + args.warmup, seed=batch)
        x = torch.randn(batch, shape.hidden).bfloat16()
        times, readings = [], []
        for c in range(args.warmup + args.calls):
            probe_due(args, c, readings)
            times.append(seconds(functools.partial(forward, x, ids[c], w[c], *layers[c % len(layers)])))
        median = statistics.median(times[args.warmup:])
        rows.append(row(shape, impl, batch, median, ids[args.warmup:], per_expert, readings))
    return rows


def bench_torch_int4(shape: Shape, kept: int, args: argparse.Namespace) -> list[dict]:
    if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        print("  skip torch-int4pack: this torch has no _weight_int4pack_mm_for_cpu")
        return []
    h, i = shape.hidden, shape.inter
    g = torch.Generator().manual_seed(2)

    def pack(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
        sz = torch.zeros(k // 32, n, 2, dtype=torch.bfloat16)
        sz[..., 0] = 0.01
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2), sz

    seed = [pack(i, h), pack(i, h), pack(h, i)]
    per_expert = sum(p.numel() + sz.numel() * 2 for p, sz in seed)
    n_layers = plan_layers(kept * per_expert, args)
    if n_layers < 1:
        return []
    stacked = [torch.stack([p] * SEEDS) for p, _ in seed] + [torch.stack([sz] * SEEDS) for _, sz in seed]
    layers = [copies(stacked, kept) for _ in range(n_layers)]
    mm = torch.ops.aten._weight_int4pack_mm_for_cpu

    def forward(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        gp, up, dp, gs, us, ds = weights  # int4-packed gate / up / down [kept, ...] and their scales
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():
            tok, slot = (ids == e).nonzero(as_tuple=True)
            hh = x[tok]
            y = mm(F.silu(mm(hh, gp[e], 32, gs[e])) * mm(hh, up[e], 32, us[e]), dp[e], 32, ds[e])
            out.index_add_(0, tok, y * w[tok, slot, None].to(x.dtype))
        return out

    print(f"  torch-int4pack: {n_layers} layers")
    return time_torch(shape, "torch-int4pack", forward, layers, kept, per_expert, args)


def print_table(rows: list[dict], bandwidth: float) -> None:
    print(f"\nRAM read bandwidth (same pool), at the start: {bandwidth / 1e9:.1f} GB/s; 'of bw' is against the median "
          "of the probes read among each row's calls (column 'RAM', their range beside it)")
    print(f"{'shape':<10} {'impl':<36} {'batch':>5} {'us/call':>9} {'experts':>8} {'MB/call':>8} {'GB/s':>7} "
          f"{'RAM':>6} {'range':>11} {'of bw':>6}")
    for r in rows:
        spread = f"{r['ram_gbps_min']:.0f}-{r['ram_gbps_max']:.0f}"
        print(f"{r['shape']:<10} {r['impl']:<36} {r['batch']:>5} {r['median_us']:>9.0f} {r['distinct']:>8.1f} "
              f"{r['mb_per_call']:>8.1f} {r['gbps']:>7.1f} {r['ram_gbps']:>6.1f} {spread:>11} {r['share'] * 100:>5.0f}%")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="both", choices=[*SHAPES, "both"])
    p.add_argument("--fmt", default="bf16,mxfp4,int4", help=f"comma list of {','.join(ce.WEIGHT_FORMATS)}")
    p.add_argument("--batches", default="1,2,4,8")
    p.add_argument("--threads", type=int, default=None, help="kernel (and torch) threads; default the kernel's")
    p.add_argument("--isa", default=None,
                   help=f"force the kernel's ISA ({', '.join(ce.ISAS)}; default the best); a comma list A/Bs them, "
                        "interleaved per call")
    p.add_argument("--num-experts-kept", type=int, default=None, help="route over this many experts (default all)")
    p.add_argument("--layers", type=int, default=0, help="layers cycled per call (default: enough for a cold working set)")
    p.add_argument("--calls", type=int, default=50, help="timed calls per batch")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--bw-gib", type=float, default=1.0, help="buffer of the read-bandwidth probe")
    p.add_argument("--probe-every", type=int, default=10, metavar="N",
                   help="read the bandwidth again every N calls (0: once, before each batch's calls)")
    p.add_argument("--max-gib", type=float, default=None, help="memory for one run's weights (default 70%% of available)")
    p.add_argument("--no-torch", action="store_true", help="skip the torch baselines")
    p.add_argument("--quick", action="store_true", help="a small shape and few calls: seconds")
    p.add_argument("--act-dtype", default="auto", metavar="auto,int8",
                   help="the kernel's activation modes (int8: LOSSY, int4 / mxfp4 weights only); a comma list A/Bs "
                        "them, interleaved per call")
    p.add_argument("--prefetch", default=None, metavar="L1:L2,...",
                   help="A/B the kernels' software-prefetch distances in bytes (0: off), interleaved per call")
    p.add_argument("--dynamic", default=None, metavar="PCT,...",
                   help="A/B the share of each phase the kernel's threads claim as they finish (percent; 0: all "
                        "split up front; 'steal': work stealing instead), interleaved per call")
    p.add_argument("--profile", action="store_true",
                   help="time each part of the kernel's calls per thread (wake-up, gather, the two phases, the "
                        "barrier waits) and print the mean and max over threads")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    args.dynamic = [None] if not args.dynamic else [v if v == "steal" else int(v) for v in args.dynamic.split(",")]
    args.prefetch = [None] if not args.prefetch else [
        tuple(int(v) for v in pair.split(":")) for pair in args.prefetch.split(",")]
    args.batches = [int(b) for b in args.batches.split(",")]
    args.isas = [None] if not args.isa else args.isa.split(",")
    for isa in args.isas:
        if isa is not None and isa not in ce.ISAS:
            p.error(f"unknown ISA {isa!r}; known: {', '.join(ce.ISAS)}")
    args.acts = args.act_dtype.split(",")
    for act in args.acts:
        if act not in ce.ACT_DTYPES:
            p.error(f"unknown activation mode {act!r}; known: {', '.join(ce.ACT_DTYPES)}")
    fmts = args.fmt.split(",")
    for fmt in fmts:
        if fmt not in ce.WEIGHT_FORMATS:
            p.error(f"unknown format {fmt!r}")
    shapes = [QUICK] if args.quick else list(SHAPES.values()) if args.shape == "both" else [SHAPES[args.shape]]
    if args.quick:
        args.calls, args.warmup, args.bw_gib = min(args.calls, 20), 3, min(args.bw_gib, 0.5)
    args.working_set = (0.5 if args.quick else 2.0) * GiB
    args.budget = (args.max_gib * GiB) if args.max_gib else 0.7 * available_bytes()
    if args.threads:
        ce.set_threads(args.threads)
    ce.set_isa(args.isas[0])
    torch.set_num_threads(ce.num_threads())

    args.probe = ce.ReadProbe(int(args.bw_gib * GiB))
    bandwidth = args.probe.measure(5)
    # The probe takes the better of a plain stream and one with the kernels' software prefetch
    # (AVX-512 builds): the plain stream alone beside it, interleaved, puts what it rests on on the record.
    plain_vs_best: list[tuple[float, float]] = []
    distances = ce.prefetch()
    for _ in range(5):
        ce.set_prefetch(0, 0)
        plain = args.probe.measure(3)
        ce.set_prefetch(*distances)
        plain_vs_best.append((plain, args.probe.measure(3)))
    print("read probe, plain stream / the better of it and the kernels' prefetch (GB/s): "
          + ", ".join(f"{a / 1e9:.0f}/{b / 1e9:.0f}" for a, b in plain_vs_best))
    switches = {k: v for k, v in os.environ.items() if k.startswith("TANDEM_CPU_")}  # debugging switches in effect
    print(f"{cpu_name()}: kernel {ce.kernel_isa()}, {ce.num_threads()} threads, "
          f"RAM read {bandwidth / 1e9:.1f} GB/s; switches {switches or 'none'}")
    rows: list[dict] = []
    for shape in shapes:
        kept = min(args.num_experts_kept or shape.experts, shape.experts)
        print(f"{shape.name}: H={shape.hidden} I={shape.inter} E={shape.experts} (kept {kept}) k={shape.top_k}")
        for fmt in fmts:
            rows += bench_tandem(shape, fmt, kept, args)
        if not args.no_torch:
            rows += bench_torch_bf16(shape, kept, args)
            rows += bench_torch_int4(shape, kept, args)
    print_table(rows, bandwidth)
    if args.out:
        meta = {"isa": ce.kernel_isa(), "threads": ce.num_threads(), "ram_read_gbps": bandwidth / 1e9,
                "probe_plain_vs_best_gbps": [(a / 1e9, b / 1e9) for a, b in plain_vs_best],
                "cpu": cpu_name(), "torch": torch.__version__, "switches": switches}
        args.out.write_text(json.dumps({"machine": meta, "rows": rows}, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
