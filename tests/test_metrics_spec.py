"""engine/metrics.py's speculative-decoding metrics: the stats line split by phase with the K
distribution, and the Prometheus counters (drafts by phase, request-steps by K and phase)."""

from __future__ import annotations

import re

import pytest

from tandem.engine.metrics import EngineMetrics, StatsWindow


def _spec(w: StatsWindow) -> str:
    line = w.line(running=1, waiting=0, kv_usage=0.5, prefix_queries=0, prefix_hits=0)
    head, sep, spec = line.partition("; SpecDecoding metrics: ")
    assert head.startswith("Avg prompt throughput: ") and "Prefix cache hit rate: " in head
    return spec if sep else ""


def test_nothing_counted_leaves_the_line_without_a_spec_part():
    w = StatsWindow(start=0.0)
    w.generation_tokens = 10
    assert _spec(w) == ""
    assert "SpecDecoding" not in w.line(0, 0, 0.0, 0, 0)


def test_overall_part_keeps_vllm_form_and_sums_the_phases():
    w = StatsWindow(start=0.0)
    # reasoning: 4 drafts of 3 tokens, accepted 3, 1, 0, 2 -> 6/12; per position 3/4, 2/4, 1/4
    for a in (3, 1, 0, 2):
        w.count_draft("reasoning", 3, a)
    # content: 1 draft of 2 tokens, both accepted
    w.count_draft("content", 2, 2)
    spec = _spec(w)
    overall = spec.split("; ")[0]
    # 5 drafts, 14 drafted, 8 accepted; per position (3+1)/5, (2+1)/5, 1/5
    assert re.fullmatch(
        r"Mean acceptance length: 2\.60, Accepted throughput: [0-9.]+ tokens/s, Drafted throughput: [0-9.]+ tokens/s, "
        r"Accepted: 8 tokens, Drafted: 14 tokens, Per-position acceptance rate: 0\.800, 0\.600, 0\.200, "
        r"Avg Draft acceptance rate: 57\.1%", overall), overall
    assert w.total.num_drafts == 5 and w.total.accepted_per_pos == [4, 3, 1]


def test_per_phase_parts():
    w = StatsWindow(start=0.0)
    for a in (3, 1, 0, 2):
        w.count_draft("reasoning", 3, a)
    w.count_draft("content", 2, 2)
    w.count_draft("tool_call", 4, 0)
    parts = _spec(w).split("; ")
    assert parts[1:4] == [
        "[content] mean acceptance length 3.00, accepted 2/2 (100.0%), per-position 1.000, 1.000",
        "[reasoning] mean acceptance length 2.50, accepted 6/12 (50.0%), per-position 0.750, 0.500, 0.250",
        "[tool_call] mean acceptance length 1.00, accepted 0/4 (0.0%), per-position 0.000, 0.000, 0.000, 0.000",
    ]
    assert len(parts) == 4  # no K counted: no K part


def test_k_distribution_is_shares_of_each_phase_request_steps():
    w = StatsWindow(start=0.0)
    for k in (1, 1, 1, 1, 0):
        w.count_k("reasoning", k)
    for k in (2, 2):
        w.count_k("content", k)
    for k in (3, 1, 3, 0):
        w.count_k("tool_call", k)
    w.count_draft("content", 2, 1)
    parts = _spec(w).split("; ")
    assert parts[1] == "[content] mean acceptance length 2.00, accepted 1/2 (50.0%), per-position 1.000, 0.000"
    # largest share first; ties by smaller K
    assert parts[-1] == "K: content {2: 100%}, reasoning {1: 80%, 0: 20%}, tool_call {3: 50%, 0: 25%, 1: 25%}"


def test_k_without_drafts_says_no_drafts():
    w = StatsWindow(start=0.0)
    w.count_k("content", 0)
    w.count_k("content", 0)
    assert _spec(w) == "no drafts; K: content {0: 100%}"


def test_throughputs_use_the_window_length(monkeypatch):
    w = StatsWindow(start=100.0)
    w.count_draft("content", 4, 3)
    w.count_draft("content", 4, 1)
    monkeypatch.setattr("tandem.engine.metrics.time.monotonic", lambda: 102.0)
    spec = _spec(w)
    assert "Accepted throughput: 2.00 tokens/s, Drafted throughput: 4.00 tokens/s" in spec


def _samples(metrics: EngineMetrics, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    out = {}
    for family in metrics.registry.collect():
        for s in family.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def test_prometheus_k_counter():
    m = EngineMetrics("m")
    for phase, k in [("reasoning", 1), ("reasoning", 1), ("reasoning", 0), ("content", 3)]:
        m.count_k(phase, k)
    got = _samples(m, "tandem:spec_decode_k_total")
    assert got == {
        (("k", "1"), ("model_name", "m"), ("phase", "reasoning")): 2.0,
        (("k", "0"), ("model_name", "m"), ("phase", "reasoning")): 1.0,
        (("k", "3"), ("model_name", "m"), ("phase", "content")): 1.0,
    }
    family = next(f for f in m.registry.collect() if f.name == "tandem:spec_decode_k")
    assert family.type == "counter" and family.documentation == "Request-steps by chosen draft depth K and phase"


def test_prometheus_draft_counters_by_phase():
    # Drafts are tallied and reach the counters at flush_drafts (the engine flushes once a step).
    m = EngineMetrics("m")
    m.count_draft("reasoning", 3, 2)
    m.count_draft("reasoning", 3, 0)
    m.count_draft("content", 2, 1)
    assert _samples(m, "tandem:spec_decode_num_drafts_total") == {}
    flushed = m.flush_drafts()
    assert flushed["reasoning"].accepted_per_pos == [1, 1, 0] and flushed["content"].num_drafts == 1
    assert m.flush_drafts() == {}  # flushed once
    r, c = (("model_name", "m"), ("phase", "reasoning")), (("model_name", "m"), ("phase", "content"))
    assert _samples(m, "tandem:spec_decode_num_drafts_total") == {r: 2.0, c: 1.0}
    assert _samples(m, "tandem:spec_decode_num_draft_tokens_total") == {r: 6.0, c: 2.0}
    assert _samples(m, "tandem:spec_decode_num_accepted_tokens_total") == {r: 2.0, c: 1.0}
    per_pos = _samples(m, "tandem:spec_decode_num_accepted_tokens_per_pos_total")
    assert per_pos == {
        (("model_name", "m"), ("phase", "reasoning"), ("position", "0")): 1.0,
        (("model_name", "m"), ("phase", "reasoning"), ("position", "1")): 1.0,
        (("model_name", "m"), ("phase", "content"), ("position", "0")): 1.0,
    }


@pytest.mark.parametrize("phase", ["reasoning", "content", "tool_call"])
def test_window_and_prometheus_agree(phase):
    m, w = EngineMetrics("m"), StatsWindow(start=0.0)
    for n, a in [(3, 3), (3, 0), (2, 1)]:
        m.count_draft(phase, n, a, 1.5)
    w.add_drafts(m.flush_drafts())
    direct = StatsWindow(start=0.0)
    for n, a in [(3, 3), (3, 0), (2, 1)]:
        direct.count_draft(phase, n, a, 1.5)
    assert w.drafts[phase] == direct.drafts[phase]  # summed once a step or counted one by one
    labels = (("model_name", "m"), ("phase", phase))
    assert _samples(m, "tandem:spec_decode_num_drafts_total")[labels] == w.drafts[phase].num_drafts == 3
    assert _samples(m, "tandem:spec_decode_num_accepted_tokens_total")[labels] == w.drafts[phase].num_accepted_tokens == 4
