"""The expert-offload benchmarks' arithmetic and their in-process stream gap on CPU: the gain a
hit rate predicts (bench_hot_experts.py) on hand-worked numbers, and the decode gaps while a long
prompt prefills alongside (bench_stream_prefill.py) on the tiny shape."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import bench_hot_experts  # noqa: E402
import bench_stream_prefill  # noqa: E402


def test_the_hit_rate_predicts_the_gain_from_the_cpu_share_of_a_step():
    # Batch 1 at 50 tok/s (a 20 ms step) of which 10 ms is CPU expert work: a 20% hit rate takes
    # 2 ms off, so 20 / 18 = 1.111x; the cached run measured 55 tok/s (1.1x).
    plain = {"hot_gib": 0.0, "decode": [{"batch": 1, "decode_tok_s": 50.0, "replay_s": 0.015,
                                         "replay_no_cpu_experts_s": 0.005}]}
    again = {"hot_gib": 0.0, "decode": [{"batch": 1, "decode_tok_s": 50.0, "replay_s": 0.014,
                                         "replay_no_cpu_experts_s": 0.004}]}
    cached = {"hot_gib": 8.0, "decode": [{"batch": 1, "decode_tok_s": 55.0, "hit_rate": 0.2}]}
    (row,) = bench_hot_experts.predicted_gains([plain, cached, again], [1, 4])  # batch 4 was not run
    assert row["t0_s"] == pytest.approx(0.02) and row["t_cpu_s"] == pytest.approx(0.01)
    assert row["predicted_gain"] == pytest.approx(20 / 18) and row["measured_gain"] == pytest.approx(1.1)
    assert row["uncached_tok_s"] == [50.0, 50.0]


def test_stream_gap_counts_the_decodes_that_wait_for_the_intruders_prefill(tmp_path):
    from tiny_models import save_tiny_model

    from tandem import LLM

    save_tiny_model(tmp_path, "qwen3_moe", seed=3, num_hidden_layers=1)
    engine = LLM(str(tmp_path), device="cpu", dtype="float32", kv_cache_memory="8MiB", max_num_seqs=2,
                 max_num_batched_tokens=64).engine
    gap = bench_stream_prefill.stream_gap(engine, intruder=200, decode_tokens=16, after=4)
    # 200 prompt tokens in steps of 64 shared with the decode: 4 steps, each giving the decoding
    # request one token while the intruder waits for its first.
    assert gap["decode_tokens_during"] >= 3 and gap["intruder_ttft_s"] > 0
    assert gap["max_gap_during_s"] > 0 and gap["itl_before_median_s"] > 0
