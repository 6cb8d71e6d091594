"""benchmarks/bench_gpu.py's verify-step cost on CPU: the tiny shape end to end (eager), the loud
failure when graphs are required but a step ran eagerly, and the fit over depths on exact data."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import bench_gpu  # noqa: E402


@pytest.fixture
def engine():
    cfg = dict(bench_gpu.TINY_QWEN3_MOE, num_hidden_layers=1)
    with bench_gpu.model_dir(cfg) as path:
        yield bench_gpu.build_engine(cfg, path, 4, 256, 0.01, enforce_eager=False, device="cpu", max_k=2)


def test_verify_cost_on_cpu_times_every_batch_and_query_length_and_frees_its_blocks(engine):
    free = engine.kv.num_free_blocks
    rows = bench_gpu.bench_verify_cost(engine, [1, 4], max_q=3, context=20, iters=2, require_graphs=False)
    assert [(r["batch"], r["q"]) for r in rows] == [(b, q) for b in (1, 4) for q in (1, 2, 3)]
    assert all(r["graphed"] is False and r["median_ms"] > 0 and r["layers"] == 1 for r in rows)
    assert [r["ratio_to_q1"] for r in rows if r["q"] == 1] == [1.0, 1.0]
    assert [r["delta_ms"] is None for r in rows] == [q == 1 for _ in (1, 4) for q in (1, 2, 3)]
    assert [m["batch"] for m in bench_gpu.marginal_costs(rows)] == [1, 4]
    assert engine.kv.num_free_blocks == free


def test_verify_cost_fails_loudly_when_a_step_runs_eagerly_but_graphs_are_required(engine):
    with pytest.raises(RuntimeError, match="ran eagerly instead of replaying a CUDA graph"):
        bench_gpu.bench_verify_cost(engine, [1], max_q=2, context=8, iters=1, require_graphs=True)


def test_extrapolate_layers_recovers_a_linear_depth_cost():
    rows = bench_gpu.add_ratios([{"layers": n, "batch": 1, "q": q, "median_ms": 1.0 + n * (0.5 + 0.1 * q)}
                                 for n in (4, 16) for q in (1, 2)])
    fit = {r["q"]: r for r in bench_gpu.extrapolate_layers(rows, 48)}
    assert fit[1]["median_ms"] == pytest.approx(1.0 + 48 * 0.6)
    assert fit[2]["per_layer_ms"] == pytest.approx(0.7) and fit[2]["fixed_ms"] == pytest.approx(1.0)
    assert fit[2]["ratio_to_q1"] == pytest.approx((1.0 + 48 * 0.7) / (1.0 + 48 * 0.6))
