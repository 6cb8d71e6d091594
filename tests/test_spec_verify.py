"""Speculative verification (spec/verify.py) on hand-made logits: greedy equals stepping the
non-speculative sampler token for token; sampled tokens follow the target's distribution."""

import math
import random
import zlib

import pytest
import torch

from tandem.core import Request, SamplingParams
from tandem.engine.sampler import Sampler, apply_penalties, filter_logits
from tandem.spec import verify as verify_mod
from tandem.spec.verify import VerifyResult, penalized_logits, target_probs, verify


def req(params: SamplingParams, prompt=(1, 2, 3), outputs=(), eos=(), rid="r") -> Request:
    r = Request(rid, list(prompt), params, eos_token_ids=frozenset(eos))
    r.output_token_ids = list(outputs)
    return r


# ---- greedy: token for token what the non-speculative sampler produces ----------------------------

GV, EOS, STOP = 16, 0, 7


def toy_logits(tokens: list[int]) -> torch.Tensor:
    """A deterministic stand-in for the target model: logits [GV] after `tokens`. It likes to repeat
    its last token (so penalties change the argmax) and to end (so min_tokens does)."""
    g = torch.Generator().manual_seed(zlib.crc32(bytes(tokens)))
    x = torch.randn(GV, generator=g)
    x[tokens[-1]] += 2.5
    x[EOS] += 1.5
    x[STOP] += 1.0
    return x


def greedy_reference(params: SamplingParams, n: int) -> list[int]:
    """n tokens from stepping the non-speculative sampler (it never stops: EOS is just a token)."""
    r, s = req(params, eos=(EOS,)), Sampler("cpu")
    for _ in range(n):
        r.output_token_ids.append(s(toy_logits(r.all_token_ids)[None], [r]).token_ids[0])
    return r.output_token_ids


def greedy_speculative(params: SamplingParams, n: int, ref: list[int], seed: int = 0) -> tuple[list[int], int]:
    """n tokens by verifying drafts: the reference's continuation with tokens corrupted at random,
    K in 0..4. Returns the tokens and the number of drafts accepted."""
    rng = random.Random(seed)
    r, accepted = req(params, eos=(EOS,)), 0
    while r.num_output_tokens < n:
        k = rng.randint(0, 4)
        at = r.num_output_tokens
        draft = [t if rng.random() < 0.75 else rng.randrange(GV) for t in (ref + [1] * 5)[at : at + k]]
        rows = torch.stack([toy_logits(r.all_token_ids + draft[:i]) for i in range(k + 1)])  # [K+1, GV]
        res = verify(r, draft, rows)
        assert res.tokens[: res.num_accepted] == draft[: res.num_accepted] and len(res.tokens) == res.num_accepted + 1
        r.output_token_ids += res.tokens
        accepted += res.num_accepted
    return r.output_token_ids[:n], accepted


GREEDY_CASES = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.0, repetition_penalty=1.8, min_tokens=6),
    SamplingParams(temperature=0.0, presence_penalty=1.0, frequency_penalty=0.7, min_tokens=4, stop_token_ids=[STOP]),
    SamplingParams(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.5, min_tokens=9,
                   stop_token_ids=[STOP]),
]


@pytest.mark.parametrize("params", GREEDY_CASES)
def test_greedy_equals_stepping_the_sampler(params, monkeypatch):
    n = 40
    ref = greedy_reference(params, n)
    for seed in range(3):
        got, accepted = greedy_speculative(params, n, ref, seed)
        assert got == ref
        assert accepted >= n // 3  # drafts were accepted, at positions > 0 too: draft[:i] was in the history
    if params.needs_penalties or params.min_tokens:
        # The case matters: the same loop, with penalties and min_tokens blind to the draft, goes wrong.
        assert greedy_reference(SamplingParams(temperature=0.0), n) != ref
        real = penalized_logits
        monkeypatch.setattr(verify_mod, "penalized_logits", lambda logits, r, draft: real(logits, r, []))
        assert greedy_speculative(params, n, ref)[0] != ref


def test_greedy_bonus_when_all_accepted_and_no_draws():
    params = SamplingParams(temperature=0.0, presence_penalty=0.5)
    ref = greedy_reference(params, 5)
    r = req(params, eos=(EOS,))
    rows = torch.stack([toy_logits(r.all_token_ids + ref[:i]) for i in range(5)])
    g = torch.Generator().manual_seed(0)
    state = g.get_state()
    res = verify(r, ref[:4], rows, draft_probs=torch.full((4, GV), 1.0 / GV), generator=g)  # q is ignored
    assert res == VerifyResult(ref, 4)
    assert torch.equal(g.get_state(), state)  # greedy draws nothing


def test_min_tokens_rejects_an_early_eos_draft():
    # EOS is the raw argmax of every row; with min_tokens=2 rows 0 and 1 mask it, row 2 does not.
    logits = torch.tensor([[5.0, 1.0, 2.0, 0.0]]).repeat(3, 1)
    r = req(SamplingParams(temperature=0.0, min_tokens=2), eos=(0,))
    assert verify(r, [0, 2], logits).tokens == [2]
    assert verify(r, [2, 2], logits).tokens == [2, 2, 0]
    probs = target_probs(logits, r, [2, 2])
    assert probs[:, 0].tolist() == [0.0, 0.0, 1.0]


# ---- sampling: the emitted tokens follow the target's distribution ----------------------------------

V = 8
LAST = 5  # the last generated token: the target's row 0 comes after it
PARAMS = SamplingParams(temperature=0.8, top_k=6, top_p=0.95, presence_penalty=0.5, repetition_penalty=1.2)
_g = torch.Generator().manual_seed(28)  # chosen so that acceptance is ~70% per position
T = torch.randn(V, V, generator=_g) * 1.5  # target "model": logits after token t are T[t]
Q = torch.softmax(T + torch.randn(V, V, generator=_g), dim=-1)  # draft "model": probs after token t are Q[t]


def reference_probs(history: list[int]) -> torch.Tensor:
    """[V]: what the non-speculative sampler draws from after PROMPT + history, computed with its
    own row functions (not verify's)."""
    r = req(PARAMS, outputs=history)
    return torch.softmax(filter_logits(apply_penalties(T[history[-1]].clone(), r, PARAMS), PARAMS), dim=-1)


def tv(counts: torch.Tensor, probs: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - probs).abs().sum())


def tv_bound(n: int) -> float:
    """An empirical distribution of n draws over V outcomes is this far (TV) from the true one with
    probability < 1e-6: E||p_n - p||_1 <= sqrt(V/n), plus McDiarmid's deviation sqrt(2 ln(1e6)/n)."""
    return 0.5 * (math.sqrt(V / n) + math.sqrt(2 * math.log(1e6) / n))


def expected_by_position(draft_q) -> list[torch.Tensor]:
    """Exact distributions, for K=2, of the first emitted token, of the second given the first draft
    was accepted, and of the third (the bonus) given both were. draft_q(history) is the drafter's q
    after LAST + history (a one-hot for a fixed draft)."""
    out, weights = [], {(): 1.0}  # weights: P(this draft prefix is drafted and accepted)
    for _ in range(3):
        dist, nxt = torch.zeros(V), {}
        for prefix, w in weights.items():
            p = reference_probs([LAST, *prefix])
            dist += w * p
            accept = torch.minimum(p, draft_q(list(prefix)))  # P(draft x and accept x) = min(p, q)(x)
            for x in range(V):
                if accept[x] > 0:
                    nxt[(*prefix, x)] = w * float(accept[x])
        out.append(dist / dist.sum())
        weights = nxt
    return out


def run_verify(n: int, draw_drafts, seed: int = 0) -> list[VerifyResult]:
    """n verification steps of K=2 from the same state; draw_drafts(gen) -> (draft, draft_probs)."""
    r, g, gd = req(PARAMS, outputs=[LAST]), torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + 1)
    results = []
    for _ in range(n):
        draft, q = draw_drafts(gd)
        rows = torch.stack([T[LAST], T[draft[0]], T[draft[1]]])  # [3, V]
        results.append(verify(r, draft, rows, q, g))
    return results


def model_drafts(gen):
    d0 = int(torch.multinomial(Q[LAST], 1, generator=gen))
    d1 = int(torch.multinomial(Q[d0], 1, generator=gen))
    return [d0, d1], torch.stack([Q[LAST], Q[d0]])


def tvs_by_position(results: list[VerifyResult], expected: list[torch.Tensor]) -> list[tuple[float, float]]:
    """(TV, bound) of emitted token i among the results that accepted i drafts or more, i = 0, 1, 2
    (positions no result reached are left out)."""
    out = []
    for i, want in enumerate(expected):
        counts = torch.zeros(V)
        for res in results:
            if res.num_accepted >= i:
                counts[res.tokens[i]] += 1
        if counts.sum() > 0:
            out.append((tv(counts, want), tv_bound(int(counts.sum()))))
    return out


def test_rejection_sampling_keeps_the_target_distribution(monkeypatch):
    n = 16000
    results = run_verify(n, model_drafts)
    expected = expected_by_position(lambda prefix: Q[([LAST] + prefix)[-1]])
    tvs = tvs_by_position(results, expected)
    assert len(tvs) == 3 and all(dist < bound for dist, bound in tvs)
    # The acceptance rate of the first draft is sum(min(p, q)).
    beta = float(torch.minimum(reference_probs([LAST]), Q[LAST]).sum())
    rate = sum(r.num_accepted >= 1 for r in results) / n
    assert abs(rate - beta) < 5 * math.sqrt(beta * (1 - beta) / n)

    # The same check fails a sampler that, on rejection, resamples from p instead of max(0, p - q).
    monkeypatch.setattr(verify_mod, "_residual", lambda p, q, d: p)
    dist, bound = tvs_by_position(run_verify(4000, model_drafts), expected)[0]
    assert dist > 2 * bound


def test_deterministic_drafts_are_one_hot_q():
    # A "greedy drafter" (always Q's argmax) verified with None (one-hot q) is lossless; verified
    # against its softmax it is not (its tokens were not drawn from that q).
    def argmax_drafts(gen):
        d0 = int(Q[LAST].argmax())
        return [d0, int(Q[d0].argmax())], None

    def onehot(prefix):
        return torch.nn.functional.one_hot(Q[([LAST] + prefix)[-1]].argmax(), V).float()

    expected = expected_by_position(onehot)
    tvs = tvs_by_position(run_verify(4000, argmax_drafts), expected)
    assert len(tvs) == 3 and all(dist < bound for dist, bound in tvs)

    def argmax_drafts_with_softmax(gen):
        draft, _ = argmax_drafts(gen)
        return draft, torch.stack([Q[LAST], Q[draft[0]]])

    dist, bound = tvs_by_position(run_verify(2000, argmax_drafts_with_softmax), expected)[0]
    assert dist > 2 * bound


def test_ngram_draft_outside_the_support_is_always_rejected():
    p0 = reference_probs([LAST])
    out = int(p0.argmin())  # filtered out by top-k / top-p: p = 0
    assert p0[out] == 0
    results = run_verify(2000, lambda gen: ([out, 1], None))
    assert all(r.num_accepted == 0 for r in results)
    counts = torch.bincount(torch.tensor([r.tokens[0] for r in results]), minlength=V).float()
    assert tv(counts, p0) < tv_bound(2000)


def test_model_draft_with_q_zero_is_rejected():
    # The drafter claims q(x) = 0 for the token it proposed (it cannot have drawn it from q): the
    # draft is rejected, and the token comes from max(0, p - q).
    p0 = reference_probs([LAST])
    x = int(p0.argmax())
    q = torch.full((2, V), 1.0 / (V - 1))
    q[:, x] = 0.0
    residual_support = set(((p0 - q[0]).clamp_min(0) > 0).nonzero().flatten().tolist())
    results = run_verify(300, lambda gen: ([x, x], q))
    assert all(r.num_accepted == 0 and r.tokens[0] in residual_support for r in results)
    assert {r.tokens[0] for r in results} == residual_support


def test_all_accepted_gives_the_bonus_token():
    # top_k=1: p is one-hot at each row's argmax, so the argmax drafts are always accepted.
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(1))
    r = req(SamplingParams(temperature=1.0, top_k=1))
    best = logits.argmax(dim=-1).tolist()
    for seed in range(20):
        res = verify(r, best[:3], logits, torch.full((3, V), 1.0 / V), torch.Generator().manual_seed(seed))
        assert res == VerifyResult(best, 3)


# ---- seeds, K = 0, logprobs, errors ---------------------------------------------------------------


def test_seeded_verify_reproduces():
    def run(seed):
        return [(r.tokens, r.num_accepted) for r in run_verify(60, model_drafts, seed)]

    assert run(3) == run(3)
    assert run(3) != run(4)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.9, top_p=0.9),
    SamplingParams(temperature=1.2, top_k=5, min_p=0.05, presence_penalty=0.4, repetition_penalty=1.3),
    SamplingParams(temperature=0.0, frequency_penalty=0.5),
])
def test_k0_is_the_samplers_draw(params):
    logits = torch.randn(1, 32, generator=torch.Generator().manual_seed(2)) * 2
    for seed in range(100):
        p = SamplingParams(**{**params.__dict__, "seed": seed})
        want = Sampler("cpu")(logits, [req(p, outputs=(4, 4, 9))]).token_ids[0]
        got = verify(req(p, outputs=(4, 4, 9)), [], logits, generator=torch.Generator().manual_seed(seed))
        assert got == VerifyResult([want], 0)


def test_logprobs_come_from_the_raw_rows():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(3))
    r = req(SamplingParams(temperature=0.0, logprobs=2, repetition_penalty=2.0))
    draft = logits.argmax(dim=-1).tolist()[:2]  # the raw argmax; the penalty may reject it
    res = verify(r, draft, logits)
    assert len(res.logprobs) == len(res.tokens)
    raw = torch.log_softmax(logits, dim=-1)
    for i, (t, lp) in enumerate(zip(res.tokens, res.logprobs)):
        assert lp.chosen.token_id == t and lp.chosen.logprob == pytest.approx(float(raw[i, t]))
        assert [x.token_id for x in lp.top] == raw[i].topk(2).indices.tolist()
    assert verify(req(SamplingParams(temperature=0.0)), [], logits[:1]).logprobs is None


def test_bad_shapes_say_what_is_wrong():
    r = req(SamplingParams())
    with pytest.raises(ValueError, match="K\\+1 = 3 logits rows"):
        verify(r, [1, 2], torch.zeros(2, V))
    with pytest.raises(ValueError, match="draft tokens must be ids"):
        verify(r, [V], torch.zeros(2, V))
    with pytest.raises(ValueError, match="draft_probs must have shape"):
        verify(r, [1], torch.zeros(2, V), torch.zeros(2, V))


def test_batched_greedy_acceptance_is_verify_for_plain_greedy_requests():
    from tandem.spec.verify import accept_greedy, is_plain_greedy

    g = torch.Generator().manual_seed(11)
    plain = req(SamplingParams(temperature=0.0, max_tokens=50))
    assert is_plain_greedy(plain)
    for params in (SamplingParams(temperature=0.0, repetition_penalty=1.2), SamplingParams(temperature=0.7),
                   SamplingParams(temperature=0.0, min_tokens=5), SamplingParams(temperature=0.0, logprobs=1)):
        assert not is_plain_greedy(req(params))
    for _ in range(50):
        k = int(torch.randint(0, 5, (1,), generator=g))
        logits = torch.randn(k + 1, 8, generator=g)
        top = logits.argmax(-1).tolist()
        # Drafts that follow the argmax for a while, then may stray.
        draft = [t if torch.rand(1, generator=g) < 0.7 else (t + 1) % 8 for t in top[:k]]
        want = verify(plain, draft, logits)
        assert accept_greedy(draft, top) == (want.tokens, want.num_accepted)
