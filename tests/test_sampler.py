"""Sampler on hand-made logits."""

import pytest
import torch

from tandem.core import MAX_LOGPROBS, ParamError, Request, SamplingParams
from tandem.engine.sampler import Sampler, apply_penalties, filter_logits, filter_logits_batch


def req(params: SamplingParams, prompt=(1, 2, 3), outputs=(), rid="r") -> Request:
    r = Request(rid, list(prompt), params)
    r.output_token_ids = list(outputs)
    return r


LOGITS = torch.tensor([[1.0, 3.0, 2.0, 0.5, -1.0, 2.9]])


def test_greedy_takes_argmax():
    out = Sampler("cpu")(LOGITS, [req(SamplingParams(temperature=0.0))])
    assert out.token_ids == [1] and out.logprobs == [None]


def test_top_k_top_p_min_p_filters():
    x = LOGITS[0]
    kept = lambda f: torch.isfinite(f).nonzero().flatten().tolist()  # noqa: E731
    assert kept(filter_logits(x, SamplingParams(top_k=2))) == [1, 5]
    # p(1) ~ 0.39, p(5) ~ 0.36: top_p 0.5 keeps both, top_p 0.3 only the first.
    assert kept(filter_logits(x, SamplingParams(top_p=0.5))) == [1, 5]
    assert kept(filter_logits(x, SamplingParams(top_p=0.3))) == [1]
    assert kept(filter_logits(x, SamplingParams(min_p=0.3))) == [1, 2, 5]


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    s = Sampler("cpu", seed=0)
    r = req(SamplingParams(temperature=1.0))
    counts = torch.zeros(3)
    for _ in range(3000):
        counts[s(logits, [r]).token_ids[0]] += 1
    assert torch.allclose(counts / 3000, torch.tensor([0.7, 0.2, 0.1]), atol=0.03)


def test_seeded_requests_reproduce():
    p = SamplingParams(temperature=1.0, seed=7)
    s1, s2 = Sampler("cpu", seed=1), Sampler("cpu", seed=2)
    seq1 = [s1(LOGITS, [req(p)]).token_ids[0] for _ in range(20)]
    seq2 = [s2(LOGITS, [req(p)]).token_ids[0] for _ in range(20)]
    assert seq1 == seq2 and len(set(seq1)) > 1


def test_penalties():
    x = torch.tensor([2.0, -2.0, 1.0, 1.0])
    r = req(SamplingParams(repetition_penalty=2.0), prompt=(0,), outputs=(1,))
    y = apply_penalties(x.clone(), r, r.params)
    assert y.tolist() == [1.0, -4.0, 1.0, 1.0]
    r = req(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), prompt=(3,), outputs=(2, 2, 1))
    y = apply_penalties(x.clone(), r, r.params)
    assert y.tolist() == [2.0, -2.75, 0.0, 1.0]  # prompt tokens are not penalised by these two


def test_min_tokens_blocks_eos():
    r = req(SamplingParams(temperature=0.0, min_tokens=2))
    r.eos_token_ids = frozenset({1})
    assert Sampler("cpu")(LOGITS, [r]).token_ids == [5]


def test_logprobs_are_raw_and_capped():
    s = Sampler("cpu")
    out = s(LOGITS, [req(SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=1.5))])
    ref = torch.log_softmax(LOGITS[0], -1)
    lp = out.logprobs[0]
    # The penalty moves the choice to token 5, but logprobs stay those of the raw model.
    assert lp.chosen.token_id == 5 and lp.chosen.logprob == pytest.approx(float(ref[5]))
    assert [t.token_id for t in lp.top] == [1, 5, 2]
    with pytest.raises(ParamError):
        SamplingParams(logprobs=MAX_LOGPROBS + 1)


@pytest.mark.parametrize("kwargs", [dict(max_tokens=0), dict(temperature=-1), dict(top_p=0.0), dict(top_p=1.5),
                                    dict(top_k=-2), dict(min_p=2.0), dict(presence_penalty=3.0),
                                    dict(repetition_penalty=0.0)])
def test_invalid_params_raise_param_error(kwargs):
    with pytest.raises(ParamError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == next(iter(kwargs))


def test_batched_filter_equals_the_row_filter():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(12, 50, generator=g) * 3
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m)
              for t, k, p, m in [(1.0, 0, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.3, 0, 0.8, 0.0), (1.0, 0, 1.0, 0.2),
                                 (0.5, 10, 0.9, 0.05), (2.0, 1, 1.0, 0.0), (1.0, 50, 0.5, 0.0), (1.0, -1, 0.99, 0.0),
                                 (0.9, 3, 0.3, 0.5), (1.1, 49, 1.0, 0.01), (1.0, 20, 0.95, 0.1), (0.3, 0, 0.1, 0.0)]]
    got = filter_logits_batch(
        logits, torch.tensor([p.temperature for p in params]), torch.tensor([p.top_k for p in params]),
        torch.tensor([p.top_p for p in params]), torch.tensor([p.min_p for p in params]))
    want = torch.stack([filter_logits(logits[i], p) for i, p in enumerate(params)])
    assert torch.equal(torch.isfinite(got), torch.isfinite(want))
    assert torch.allclose(got[torch.isfinite(got)], want[torch.isfinite(want)])


def test_batched_sampling_follows_each_rows_distribution():
    # Row 0: p = (0.7, 0.2, 0.1); row 1 keeps only its top token (top_k=1); row 2 is greedy.
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1], [0.2, 0.5, 0.3], [0.1, 0.3, 0.6]]))
    reqs = [req(SamplingParams(temperature=1.0), rid="a"), req(SamplingParams(temperature=1.0, top_k=1), rid="b"),
            req(SamplingParams(temperature=0.0), rid="c")]
    s = Sampler("cpu", seed=3)
    counts = torch.zeros(3)
    for _ in range(3000):
        a, b, c = s(logits, reqs).token_ids
        counts[a] += 1
        assert b == 1 and c == 2
    assert torch.allclose(counts / 3000, torch.tensor([0.7, 0.2, 0.1]), atol=0.03)


def test_rollback_undoes_the_last_calls_seeded_draws():
    logits = LOGITS.repeat(3, 1)
    fresh = req(SamplingParams(temperature=1.0, seed=5), rid="fresh")
    old = req(SamplingParams(temperature=1.0, seed=6), rid="old")
    unseeded = req(SamplingParams(temperature=1.0), rid="plain")
    s = Sampler("cpu")
    s(logits[:1], [old])  # "old" has drawn once before the call that will be undone
    s(logits, [fresh, old, unseeded])
    s.rollback()
    assert "fresh" not in s.generators  # created by the undone call: re-created from its seed
    # Sampling again continues each seeded stream as if the undone call never ran.
    ref = Sampler("cpu")
    ref(logits[:1], [old])
    for _ in range(5):
        assert s(logits, [fresh, old]).token_ids == ref(logits, [fresh, old]).token_ids
