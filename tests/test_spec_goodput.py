"""The goodput controller's core (tandem/spec/goodput.py) on hand-worked acceptance and cost tables."""

from __future__ import annotations

import random

import pytest

from tandem.spec.goodput import (
    AcceptanceStats,
    StepCost,
    choose_ks,
    expected_accepted,
    goodput,
    hand_cost,
)

# Batch 1 on a GPU: one more verify token costs 5% of a step (a memory-bound decode).
CHEAP = hand_cost({1: {1: 1.0, 2: 1.05, 3: 1.10, 4: 1.15, 5: 1.20}})


def test_expected_accepted_is_the_sum_of_running_products() -> None:
    rates = [0.8, 0.6, 0.4, 0.2]
    assert expected_accepted(rates, 0) == 0.0
    assert expected_accepted(rates, 2) == pytest.approx(0.8 + 0.48)
    assert expected_accepted(rates, 4) == pytest.approx(0.8 + 0.48 + 0.192 + 0.0384)


def test_batch_one_with_cheap_verify_tokens_picks_the_hand_worked_best_k() -> None:
    rates = [[0.8, 0.6, 0.4, 0.2]]
    # G(K) = (1 + E(K)) / T(K): 1.000, 1.714, 2.073, 2.150, 2.092 -> K = 3.
    by_k = [goodput(rates, [k], CHEAP) for k in range(5)]
    assert [round(g, 3) for g in by_k] == [1.0, 1.714, 2.073, 2.15, 2.092]
    assert choose_ks(rates, (1, 2, 3, 4), CHEAP) == [3]


def test_high_concurrency_where_a_verify_token_costs_a_full_token_picks_k_zero() -> None:
    # Batch 16, compute-bound: the step time grows with the tokens per request, and a batch mixing
    # depths is padded to the longest, so one request drafting makes everyone pay.
    cost = hand_cost({16: {1: 1.0, 2: 2.0, 3: 3.0}})
    rates = [[0.6, 0.3]] * 16
    assert goodput(rates, [0] * 16, cost) == pytest.approx(16.0)
    assert goodput(rates, [1] * 16, cost) == pytest.approx(12.8)
    assert goodput(rates, [1] + [0] * 15, cost) == pytest.approx(8.3)
    assert choose_ks(rates, (1, 2), cost) == [0] * 16
    # Nearly free verify tokens at batch 16: all draft together (no single request's move from
    # all-0 pays, as the padded step charges everyone; the search tries uniform depths too).
    assert choose_ks(rates, (1, 2), hand_cost({16: {1: 1.0, 2: 1.05, 3: 1.1}})) == [2] * 16
    # The same requests at batch 1 with nearly free verify tokens do draft.
    assert choose_ks([[0.6, 0.3]], (1, 2), hand_cost({1: {1: 1.0, 2: 1.05, 3: 1.1}})) == [2]


def test_a_phase_switch_moves_the_request_from_k1_to_k3() -> None:
    cost = hand_cost({1: {1: 1.0, 2: 1.25, 3: 1.5, 4: 1.75, 5: 2.0}})
    stats = AcceptanceStats(max_k=4, prior_weight=4.0)
    rng = random.Random(0)
    truth = {"reasoning": [0.3, 0.1, 0.1, 0.1], "content": [0.9, 0.85, 0.8, 0.75]}

    def verify(phase: str, k: int) -> int:
        n = 0
        while n < k and rng.random() < truth[phase][n]:
            n += 1
        return n

    ks = [0]
    for _ in range(150):  # reasoning: G = 1.00, 1.04, 0.89 at K = 0, 1, 2 -> K = 1
        ks = choose_ks([stats.rates("r", "reasoning")], (1, 2, 3, 4), cost, previous=ks)
        stats.observe("r", "reasoning", max(ks[0], 1), verify("reasoning", max(ks[0], 1)))
    assert ks == [1]
    for _ in range(150):  # content: G = 1.52, 1.78, 1.87, 1.87 at K = 1..4 -> K = 3 (or 4, a tie within 0.3%)
        ks = choose_ks([stats.rates("r", "content")], (1, 2, 3, 4), cost, previous=ks)
        stats.observe("r", "content", max(ks[0], 1), verify("content", max(ks[0], 1)))
    assert ks[0] in (3, 4)


def test_only_captured_depths_and_the_request_limit_are_chosen() -> None:
    rates = [[0.8, 0.6, 0.4, 0.2]]
    # K = 3 is the optimum; without its graph the best is 4 (G 2.092 > 2.073 at K = 2), and 2
    # when only 1 and 2 are captured.
    assert choose_ks(rates, (1, 2, 4), CHEAP) == [4]
    assert choose_ks(rates, (1, 2), CHEAP) == [2]
    # A request that may generate only one more draft token is held to K <= 1.
    assert choose_ks(rates, (1, 2, 3, 4), CHEAP, limits=[1]) == [1]
    for seed in range(20):
        rng = random.Random(seed)
        batch = [[rng.random() for _ in range(4)] for _ in range(rng.randint(1, 4))]
        cost = hand_cost({4: {q: 1.0 + rng.random() * (q - 1) * 0.3 for q in range(1, 6)}})
        assert set(choose_ks(batch, (2, 4), cost)) <= {0, 2, 4}


def test_hysteresis_keeps_the_previous_k_on_a_near_tie() -> None:
    rates = [[0.8, 0.6, 0.4, 0.2]]
    gain = goodput(rates, [3], CHEAP) / goodput(rates, [4], CHEAP) - 1
    assert 0.02 < gain < 0.03  # K = 3 beats K = 4 by 2.8%
    assert choose_ks(rates, (1, 2, 3, 4), CHEAP, previous=[4], hysteresis=0.05) == [4]  # below the bar: kept
    assert choose_ks(rates, (1, 2, 3, 4), CHEAP, previous=[4]) == [3]  # above the default 2%: moved
    assert choose_ks(rates, (1, 2, 3, 4), CHEAP, previous=[0]) == [3]  # a large gain always moves


def test_the_estimate_converges_on_a_synthetic_proposer_with_known_acceptance() -> None:
    truth = [0.9, 0.7, 0.5, 0.3]  # conditional acceptance per position
    stats = AcceptanceStats(max_k=4)
    rng = random.Random(1)
    for _ in range(400):
        n = 0
        while n < 4 and rng.random() < truth[n]:
            n += 1
        stats.observe("a", "content", 4, n)
    est = stats.rates("a", "content")
    assert all(abs(e - t) < 0.12 for e, t in zip(est, truth)), est
    cost = hand_cost({1: {1: 1.0, 2: 1.1, 3: 1.2, 4: 1.3, 5: 1.4}})
    assert choose_ks([est], (1, 2, 3, 4), cost, hysteresis=0.0) == choose_ks([truth], (1, 2, 3, 4), cost, hysteresis=0.0)
    # A new request of the same phase starts from the phase prior, not from zero.
    assert stats.rates("b", "content") == pytest.approx(stats.phase_rates("content"))
    stats.remove("a")
    assert stats.rates("a", "content") == pytest.approx(stats.phase_rates("content"))


def test_step_cost_buckets_padding_hook_and_online_refinement() -> None:
    cost = StepCost({(1, 1): 1.0, (1, 3): 1.2, (4, 1): 2.0, (4, 3): 3.0}, extra=lambda ks: 0.01 * sum(ks))
    assert cost.seconds([2, 0, 0]) == pytest.approx(3.0 + 0.02)  # bucket 4, padded to q = 3
    with pytest.raises(ValueError, match="no captured batch bucket holds 5"):
        cost.seconds([0] * 5)
    with pytest.raises(ValueError, match="query length 2"):
        cost.seconds([1])
    # Real steps take longer than the tables (host work): the residual is learned per bucket and
    # whether the drafter ran, an exponential average (smoothing 0.1), shared by every q.
    cost.observe([2], 2.2)  # modelled 1.2 + 0.02: residual 0.98
    assert cost.learned([2]) == pytest.approx(0.098)
    assert cost.learned([1]) == pytest.approx(0.098)  # another q, same bucket
    assert cost.seconds([0]) == pytest.approx(1.0 + 0.098)  # no drafting: not seen yet, the other kind's
    cost.observe([0], 1.0)  # then learned apart: 0.9 x 0.098 + 0.1 x 0
    assert cost.learned([0]) == pytest.approx(0.9 * 0.098) and cost.learned([2]) == pytest.approx(0.098)
    for _ in range(60):
        cost.observe([2], 2.2)
    assert cost.seconds([2]) == pytest.approx(2.2, rel=0.01)
    # One outlier step (10x slower) counts as twice the prediction.
    before = cost.learned([2])
    cost.observe([2], 22.0)
    assert cost.seconds([2]) == pytest.approx(0.9 * 2.2 + 0.1 * 4.4, rel=0.01)
    assert cost.seconds([0, 0]) == pytest.approx(2.0)  # bucket 4 has learned nothing


def test_step_cost_never_predicts_a_step_free_when_real_steps_beat_the_tables() -> None:
    # The tables were measured on a busy machine: real steps take a tenth of them. The residual
    # learned on deep steps is shared by the bucket's cheap ones, whose modelled time is far
    # smaller; the prediction stays at least a quarter of the tables' time (CI once saw a negative
    # prediction reach the /metrics counter, which refuses one).
    cost = StepCost({(1, 1): 0.001, (1, 4): 0.010}, extra=lambda ks: 0.002 * sum(ks))
    for _ in range(100):
        predicted = cost.observe([3], 0.0016)
        assert predicted > 0
    assert cost.learned([3]) < -0.01  # modelled 0.016, measured 0.0016
    assert cost.seconds([0]) == pytest.approx(0.25 * 0.001)
    assert cost.observe([0], 0.0009) == pytest.approx(0.25 * 0.001)


def test_step_cost_drafter_time_and_missing_buckets() -> None:
    # Buckets 1, 2, 4, 8 captured, only 1 and 4 measured: 2 and 8 are read off the line.
    cost = StepCost({(1, 1): 1.0, (1, 2): 1.1, (4, 1): 1.6, (4, 2): 2.0},
                    draft={(1, 1): 0.3, (4, 1): 0.6}, buckets=(1, 2, 4, 8))
    assert cost.seconds([0, 0]) == pytest.approx(1.2)  # bucket 2: a third of the way to 4
    assert cost.seconds([1] * 8) == pytest.approx(2.0 + 1.2 + 0.6 + 0.4)  # bucket 8: extrapolated
    assert cost.seconds([1, 0]) == pytest.approx(1.4 + 0.3)  # one request drafts: drafter bucket 1
    assert cost.seconds([1, 0], include_draft=False) == pytest.approx(1.4)  # a draft being cut: spent
    with pytest.raises(ValueError, match="drafter time at depth 2"):
        cost.seconds([1], drafted=[2])


def test_eager_steps_are_ragged_and_a_short_draft_saves_time() -> None:
    # Without graphs the step packs queries: four requests at q = 1, 1, 1, 4 cost the grid at the
    # mean q = 1.75, not at q = 4, so drafting for one request alone can pay.
    grid = {(4, 1): 1.0, (4, 4): 2.5}
    ragged = StepCost(grid, padded=False)
    assert ragged.seconds([0, 0, 0, 3]) == pytest.approx(1.0 + 1.5 * 0.75 / 3)
    assert not ragged.uniform_is_optimal and StepCost(grid).uniform_is_optimal
    rates = [[0.95, 0.95, 0.95]] + [[0.05] * 3] * 3
    assert choose_ks(rates, (3,), ragged) == [3, 0, 0, 0]
    assert choose_ks(rates, (3,), StepCost(grid)) == [0, 0, 0, 0]  # padded: everyone pays q = 4


def test_a_ragged_cost_remembers_what_it_computed() -> None:
    # modelled() is memoised for ragged costs too (CPU runs ask every step): the memo must give
    # what the tables give for any mix of depths and drafter depths.
    import random

    grid = {(b, q): 0.1 * b + 0.3 * q + 0.01 * b * q for b in (1, 4, 16) for q in (1, 2, 4, 5)}
    draft = {(b, d): 0.05 * b + 0.2 * d for b in (1, 4, 16) for d in (1, 2, 4)}
    cost = StepCost(grid, draft, buckets=(1, 4, 16), padded=False)
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 16)
        ks = [rng.choice((0, 1, 2, 4)) for _ in range(n)]
        drafted = [rng.choice((0, 1, 2, 4)) for _ in range(n)]
        for args in ((ks, None, True), (ks, drafted, True), (ks, drafted, False)):
            assert cost.modelled(*args) == pytest.approx(cost._modelled(*args), rel=1e-12)


def test_stats_decay_lets_an_estimate_follow_a_change_within_a_few_dozen_verifies() -> None:
    stats = AcceptanceStats(max_k=1, prior_weight=1.0)
    for _ in range(60):
        stats.observe("a", "content", 1, 1)
    assert stats.rates("a", "content")[0] > 0.95
    for _ in range(40):
        stats.observe("a", "content", 1, 0)
    assert stats.rates("a", "content")[0] < 0.4  # the request's own counts forget (half-life ~23)
    assert stats.phase_rates("content")[0] > 0.55  # the pooled prior forgets slowly


def test_the_histogram_counts_give_the_per_position_rates_counted_one_by_one() -> None:
    # Reference: every verify ages every count by one decay and adds 1 to each position it tried
    # (accepted up to m, then the rejection at m + 1).
    max_k, decay, weight = 5, 0.97, 4.0
    stats = AcceptanceStats(max_k, decay=decay, prior_weight=weight, phase_decay=decay)
    rng = random.Random(3)
    accepted, tried = [0.0] * max_k, [0.0] * max_k
    for _ in range(3000):  # past a renormalisation of the scaled counts (1e12 at ~900 verifies)
        k = rng.randint(1, max_k)
        m = min(k, int(rng.random() ** 0.5 * (k + 1)))
        stats.observe("a", "content", k, m)
        accepted, tried = [a * decay for a in accepted], [t * decay for t in tried]
        for i in range(min(m + 1, k)):
            tried[i] += 1.0
            accepted[i] += 1.0 if i < m else 0.0
    prior = [0.9, 0.8, 0.7, 0.6, 0.5]
    want = [(a + weight * p) / (t + weight) for a, t, p in zip(accepted, tried, prior)]
    assert stats.rates("a", "content", prior) == pytest.approx(want, rel=1e-9)
    assert [stats.request_tries("a", "content", i + 1) for i in range(max_k)] == pytest.approx(tried, rel=1e-9)
    assert [stats.phase_tries("content", i + 1) for i in range(max_k)] == pytest.approx(tried, rel=1e-9)
    chained, running = [], 0.5  # the phase prior: each position shrunk to the one before it
    for a, t in zip(accepted, tried):
        running = (a + running) / (t + 1.0)
        chained.append(running)
    assert stats.phase_rates("content") == pytest.approx(chained, rel=1e-9)
    # A request never seen in a phase has its prior; a position never tried has the prior's value.
    assert stats.rates("b", "content", prior) == prior
    stats.observe("c", "reasoning", 2, 2)
    assert stats.rates("c", "reasoning", prior)[3:] == pytest.approx(prior[3:])


def test_bad_observations_are_refused() -> None:
    with pytest.raises(ValueError, match="accepted 3 of 2"):
        AcceptanceStats(4).observe("x", "content", 2, 3)


def test_with_experts_in_ram_a_deeper_draft_pays_for_the_experts_it_reaches() -> None:
    """The CPU-expert hook (placement.cpu_expert_step_cost): a verify of more tokens reads more
    distinct experts per offloaded layer; with expensive experts the controller drafts shallower."""
    from tandem.offload.placement import LayerPlacement, Placement, cpu_expert_step_cost

    layers = tuple(LayerPlacement(i, True, "cpu", 0, 0) for i in range(4))
    placement = Placement(layers, "bf16", "test", 0, num_experts=64, top_k=4, hidden_size=256, inter_size=128,
                          run_elem=2)
    extra = cpu_expert_step_cost(placement, ram_read=1e9)  # 196 KB an expert: 0.2 ms each
    per_expert = 3 * 256 * 128 * 2 / 1e9
    assert extra([0]) == 0.0  # one token: the top-k the tables measured
    assert extra([1]) == pytest.approx(4 * (placement.distinct_experts(2) - 4) * per_expert)
    assert extra([3]) > extra([2]) > extra([1])
    verify = {(1, q): 1e-3 for q in range(1, 5)}  # a free verify token on the GPU
    rates = [[0.8, 0.8, 0.8]]
    assert choose_ks(rates, (1, 2, 3), StepCost(verify)) == [3]
    assert choose_ks(rates, (1, 2, 3), StepCost(verify, extra=extra)) == [0]  # 0.2 ms an expert vs 1 ms a step
    assert choose_ks(rates, (1, 2, 3), StepCost(verify, extra=lambda ks: extra(ks) / 5)) == [2]  # faster RAM


def test_with_async_plain_steps_k0_is_tried_before_its_estimate_counts() -> None:
    # Under async scheduling an unseen plain step costs the device's time (the drafting steps'
    # host work says nothing about it), and so it stays until MIN_PLAIN_STEPS were seen; the
    # estimate learns meanwhile and counts after that. Without async, the other kind's is used.
    from tandem.spec.goodput import MIN_PLAIN_STEPS

    cost = hand_cost({1: {1: 1.0, 2: 1.05}}, plain_overlaps=True)
    for _ in range(20):
        cost.observe([1], 1.05 + 2.0)  # drafting steps: 2 s of host work each
    assert cost.learned([1]) > 1.0 and cost.learned([0]) == 0.0
    for _ in range(MIN_PLAIN_STEPS - 1):
        cost.observe([0], 1.5)  # plain steps: 0.5 s over the table (capped at twice the prediction)
    assert cost.learned([0]) == 0.0 and cost.seconds([0]) == pytest.approx(1.0)
    cost.observe([0], 1.5)
    assert 0.4 < cost.learned([0]) < 0.5  # 0.5 * (1 - 0.9 ** 32)
    sync = hand_cost({1: {1: 1.0, 2: 1.05}})
    sync.observe([1], 3.05)
    assert sync.learned([0]) == sync.learned([1]) > 0.0
