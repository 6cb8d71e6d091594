"""Decode with routed experts in RAM, with and without the hot-expert cache on the GPU, under a
skewed routing recorded from the demo model (issue 17's hot-cache measurement).

Random weights route about uniformly, where a cache cannot help; so each MoE layer's choices are
replaced by draws from a recorded distribution:

  * `benchmarks/traces/demo_expert_counts.json`, written by
        python -m tandem.cli profile-experts tandem/assets/demo --prompts benchmarks/traces/demo_eval_prompts.jsonl \
            --out benchmarks/traces/demo_expert_counts.json --device cpu --dtype float32 --max-tokens 256
    (the demo model's 8 layers x 32 experts over its 24 held-out prompts, 3 per task family);
  * layer l of the benchmark model takes demo layer l mod 8; demo expert j's share is split evenly
    over the shape's experts j * E/32 .. (j + 1) * E/32 - 1;
  * per layer, a table of 4096 rows of top-k distinct experts is drawn (without replacement, in
    proportion to those shares, seed 0) and decode step rows read it in turn (a device counter:
    the graphs replay it); the router's own weights are kept;
  * the calibration file the planner picks hot experts from is drawn the same way with seed 1 (so
    the cache is chosen from a sample, not from the rows the run will read).

The runs, in one process on the same weights, follow `--order` (default none,hot,none: the cached
run bracketed by two uncached ones, so warm-up and drift show as the two differing): no cache, or
`--hot-gib` of hot experts (from the calibration draw, or learned online with `--online`). Decode
tok/s at each batch is the median of `--reps` runs, with the hit rate measured over them (and
since start) against the one the planner predicted.

What the hit rate predicts: in each uncached run, a decode graph is replayed with the CPU experts
computing the batch's rows and with none (the host nodes still run; the kernel is told 0 live
rows), so their difference is the step's CPU expert time t_cpu. The cache takes a share h of the
(token, expert) pairs off the CPU, so a step of t0 (the measured decode step) should take
t0 - h * t_cpu: the predicted gain is t0 / (t0 - h * t_cpu), against the measured one.

    python benchmarks/bench_hot_experts.py --layers 8 --hot-gib 8 --out hot.json     # V4-Flash expert shape
    python benchmarks/bench_hot_experts.py --shape tiny --device cpu --hot-gib 0.0002 --batches 1,2   # smoke
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gpu import SHAPES, free_device_memory, materialize_random, model_dir, run_decode  # noqa: E402
from bench_offload import DISTINCT_SETS, make_engine  # noqa: E402

from tandem.config import OffloadConfig  # noqa: E402
from tandem.models.loader import build_meta_model  # noqa: E402
from tandem.models.registry import get_model_class  # noqa: E402
from tandem.offload.cpu_executor import OffloadedExperts  # noqa: E402
from tandem.offload.hot_experts import ExpertCounts  # noqa: E402
from tandem.offload.placement import plan_placement  # noqa: E402

TRACE = Path(__file__).resolve().parent / "traces" / "demo_expert_counts.json"
ROWS = 4096


def layer_shares(demo: ExpertCounts, layers: list[int], num_experts: int) -> dict[int, torch.Tensor]:
    """Per benchmark layer, the probability of each of its experts (see the module docstring)."""
    out = {}
    demo_layers = sorted(demo.counts)
    for i in layers:
        counts = torch.tensor(demo.counts[demo_layers[i % len(demo_layers)]], dtype=torch.float64)
        p = counts / counts.sum()
        if num_experts >= p.numel():  # split each demo expert's share over num_experts / 32 experts
            per = num_experts // p.numel()
            out[i] = (p / per).repeat_interleave(per)
        else:  # a smaller shape (the smoke test's): fold groups of demo experts into one
            out[i] = p.view(num_experts, -1).sum(-1)
    return out


def draw(shares: dict[int, torch.Tensor], top_k: int, rows: int, seed: int) -> dict[int, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {i: torch.multinomial(p.expand(rows, -1), top_k, replacement=False, generator=g) for i, p in shares.items()}


class TableRouting:
    """Wraps a layer's executor: its topk_ids become the next rows of a table (a device counter)."""

    def __init__(self, inner, table: torch.Tensor) -> None:  # noqa: ANN001
        self.inner, self.table = inner, table
        self.at = torch.zeros((), dtype=torch.int64, device=table.device)

    def __call__(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        rows = (self.at + torch.arange(topk_ids.shape[0], device=topk_ids.device)) % self.table.shape[0]
        self.at += topk_ids.shape[0]
        return self.inner(hidden, self.table[rows], topk_weights)


def build(cfg: dict, path: Path, device: str, dtype: torch.dtype, offload: OffloadConfig, threads: int | None,
          rows: int):
    """The model with every routed expert in RAM (random), plus the placement's hot experts."""
    model = build_meta_model(get_model_class(cfg["model_type"]), cfg, dtype, path / "config.json")
    placement = plan_placement(model, dtype, offload, None if device == "cpu" else 1 << 50, 0)
    sink = OffloadedExperts(placement, threads, staging_rows=rows, offload=offload)
    sink.prepare(model)
    model = materialize_random(model, device)
    h, i = cfg["hidden_size"], cfg["moe_intermediate_size"]
    g = torch.Generator().manual_seed(1)
    sets = [tuple((torch.randn(*s, generator=g) * 0.02).to(dtype) for s in ((i, h), (i, h), (h, i)))
            for _ in range(DISTINCT_SETS)]
    first = None
    for layer, packed in sink.layers.items():
        if first is None:
            for e in range(packed.num_experts):
                packed.set_expert(e, *sets[e % DISTINCT_SETS])
            first = packed
        else:
            packed.data.copy_(first.data)
        for e in sink.hot.get(layer, ()):  # what the loader's take() keeps for a hot expert
            sink._hot_weights[(layer, e)] = dict(zip(("gate_proj", "up_proj", "down_proj"), sets[e % DISTINCT_SETS]))
    sink.install(model, torch.device(device), dtype)
    return model, sink, placement


def cpu_expert_seconds(engine, batch: int, repeats: int = 20) -> tuple[float, float]:  # noqa: ANN001
    """A decode graph's replay at `batch` with the CPU experts computing the batch's rows, and with
    none (0 live rows): the module docstring's t_cpu is their difference."""
    from tandem.engine.runner import seconds_per_call

    graphs = engine.runner.graphs
    graph = graphs[min(k for k in graphs if k[0] >= batch and k[1] == 1)].graph
    live = engine.model.cpu_experts.live_rows  # what a replay tells the CPU kernel

    def replay(rows: int) -> None:
        live.fill_(rows)
        graph.replay()

    full = seconds_per_call(lambda: replay(batch), engine.device, repeats, warm_up=True)
    none = seconds_per_call(lambda: replay(0), engine.device, repeats, warm_up=True)
    return full, none


def predicted_gains(runs: list[dict], batches: list[int]) -> list[dict]:
    """Per batch: the hit rate's predicted decode gain against the measured one (module docstring),
    the uncached runs averaged."""
    rows = []
    for b in batches:
        plain = [r2 for r in runs if not r["hot_gib"] for r2 in r["decode"] if r2["batch"] == b and "replay_s" in r2]
        cached = [r2 for r in runs if r["hot_gib"] for r2 in r["decode"] if r2["batch"] == b]
        if not plain or not cached:
            continue
        tok_s = sum(r["decode_tok_s"] for r in plain) / len(plain)
        t0 = b / tok_s  # the uncached decode step, host included
        t_cpu = sum(r["replay_s"] - r["replay_no_cpu_experts_s"] for r in plain) / len(plain)
        hit = cached[0]["hit_rate"]
        rows.append({"batch": b, "hit_rate": hit, "t0_s": t0, "t_cpu_s": t_cpu,
                     "predicted_gain": t0 / (t0 - hit * t_cpu), "measured_gain": cached[0]["decode_tok_s"] / tok_s,
                     "uncached_tok_s": [r["decode_tok_s"] for r in plain]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=("v4-flash-experts", "qwen3-30b-a3b", "tiny"), default="v4-flash-experts")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--hot-gib", type=float, default=8.0, help="--hot-expert-memory of the cached run")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--order", default="none,hot,none", help="the runs in turn: none (no cache) or hot")
    ap.add_argument("--reps", type=int, default=3, help="timed decode runs per batch (the median counts)")
    ap.add_argument("--online", action="store_true",
                    help="the cached run learns its hot set online (--hot-experts online) instead of from the "
                         "calibration draw; it decodes --online-warmup tokens first")
    ap.add_argument("--online-warmup", type=int, default=512)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cfg = dict(SHAPES[args.shape], num_hidden_layers=args.layers)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    batches = [int(b) for b in args.batches.split(",")]
    demo = ExpertCounts.load(TRACE)
    layers = list(range(args.layers))
    shares = layer_shares(demo, layers, cfg["num_experts"])
    table = draw(shares, cfg["num_experts_per_tok"], ROWS, seed=0)
    calib = draw(shares, cfg["num_experts_per_tok"], ROWS, seed=1)
    results: dict = {"shape": args.shape, "layers": args.layers, "trace": str(TRACE), "runs": []}
    with tempfile.TemporaryDirectory() as tmp, model_dir(cfg) as path:
        counts_file = Path(tmp) / "counts.json"
        ExpertCounts("bench", ROWS, {i: tuple(torch.bincount(t.flatten(), minlength=cfg["num_experts"]).tolist())
                                     for i, t in calib.items()}).save(counts_file)
        for hot in [args.hot_gib if name == "hot" else 0.0 for name in args.order.split(",")]:
            source = "online" if args.online else str(counts_file)
            offload = OffloadConfig(cpu_moe=True, cpu_moe_threads=args.threads, stream_experts="off",
                                    **({"hot_experts": source, "hot_expert_memory": int(hot * 2**30)} if hot else {}))
            model, sink, placement = build(cfg, path, args.device, dtype, offload, args.threads,
                                           max(batches) * 2 + 512)
            for i, block in model.moe_blocks().items():
                block.set_executor(TableRouting(block.executor, table[i].to(args.device)))
            longest = max(args.new_tokens, args.online_warmup if args.online else 0)
            engine = make_engine(path, model, args.device, dtype, 1 << 30, max(batches), args.prompt + longest + 64)
            run = {"hot_gib": hot, "hot_experts": sum(len(e) for _, e in placement.hot), "source": source if hot else "",
                   "predicted_hit_rate": placement.hot_hit_rate, "decode": []}
            if hot and sink.online is not None:  # let it learn the routing first
                run_decode(engine, 1, args.prompt, args.online_warmup, seed=99)
                run["online_swaps_in_warmup"] = sink.online.swaps
            for b in batches:
                run_decode(engine, b, args.prompt, 4, seed=100 + b)  # warm-up
                before = [(int(ex.hits), int(ex.pairs)) for ex in sink.hot_executors.values()]
                reps = [run_decode(engine, b, args.prompt, args.new_tokens, seed=b + 1000 * i) for i in range(args.reps)]
                after = [(int(ex.hits), int(ex.pairs)) for ex in sink.hot_executors.values()]
                r = sorted(reps, key=lambda x: x["decode_tok_s"])[len(reps) // 2]
                r["decode_tok_s_reps"] = [x["decode_tok_s"] for x in reps]
                pairs = sum(a[1] - b0[1] for a, b0 in zip(after, before))
                r["hit_rate"] = sum(a[0] - b0[0] for a, b0 in zip(after, before)) / pairs if pairs else 0.0
                if not hot and engine.runner.graphs:
                    r["replay_s"], r["replay_no_cpu_experts_s"] = cpu_expert_seconds(engine, b)
                run["decode"].append(r)
                split = (f"; a replay {1e3 * r['replay_s']:.2f} ms, {1e3 * r['replay_no_cpu_experts_s']:.2f} ms with no "
                         "CPU expert rows" if "replay_s" in r else "")
                print(f"hot {hot:g} GiB, batch {b}: {r['decode_tok_s']:.2f} tok/s (median of "
                      f"{', '.join(f'{x:.1f}' for x in r['decode_tok_s_reps'])}; {r['graph_steps']}/{r['steps']} in "
                      f"graphs), hit rate {100 * r['hit_rate']:.1f}% in this run{split}", flush=True)
            rates = sink.hot_hit_rates()
            run["measured_hit_rate"] = sum(rates.values()) / len(rates) if rates else 0.0
            print(f"hot {hot:g} GiB: {run['hot_experts']} hot experts, hit rate predicted "
                  f"{100 * run['predicted_hit_rate']:.1f}% measured {100 * run['measured_hit_rate']:.1f}%", flush=True)
            results["runs"].append(run)
            del engine, model, sink
            free_device_memory()
    results["predicted_vs_measured"] = predicted_gains(results["runs"], batches)
    for row in results["predicted_vs_measured"]:
        print(f"batch {row['batch']}: hit rate {100 * row['hit_rate']:.1f}%, CPU experts {1e3 * row['t_cpu_s']:.2f} of "
              f"{1e3 * row['t0_s']:.2f} ms a step -> predicted {row['predicted_gain']:.3f}x, measured "
              f"{row['measured_gain']:.3f}x (uncached runs {', '.join(f'{x:.1f}' for x in row['uncached_tok_s'])} "
              "tok/s)", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
