"""SamplingParams validation at the engine's boundary: every bad value is a ParamError naming its
field, edge values are accepted (and seeds reduced into what torch takes)."""

import dataclasses
import math

import pytest
import torch

from tandem.core import MAX_COUNT, ParamError, Request, SamplingParams, reduce_seed
from tandem.engine.sampler import Sampler

NAN, INF = math.nan, math.inf

BAD = [
    # floats: finite, in range, numbers (not bools, not strings)
    ("temperature", NAN), ("temperature", INF), ("temperature", -INF), ("temperature", -1.0),
    ("temperature", 100.5), ("temperature", 10**400), ("temperature", True), ("temperature", "hot"),
    ("temperature", None),
    ("top_p", 0.0), ("top_p", -0.5), ("top_p", 1.5), ("top_p", NAN), ("top_p", INF), ("top_p", "1"),
    ("min_p", -0.1), ("min_p", 2.0), ("min_p", NAN),
    ("presence_penalty", 3.0), ("presence_penalty", NAN), ("presence_penalty", -INF),
    ("frequency_penalty", -2.5), ("frequency_penalty", NAN), ("frequency_penalty", INF),
    ("repetition_penalty", NAN), ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
    ("repetition_penalty", 1e-300), ("repetition_penalty", 0.001), ("repetition_penalty", 1e300),
    ("repetition_penalty", INF), ("repetition_penalty", 101.0),
    # integers: ints (not bools, floats or strings), within what their consumers hold
    ("top_k", -2), ("top_k", MAX_COUNT + 1), ("top_k", 2**63), ("top_k", 2**64), ("top_k", 1.5),
    ("top_k", "5"), ("top_k", True),
    ("max_tokens", 0), ("max_tokens", -1), ("max_tokens", MAX_COUNT + 1), ("max_tokens", 2**64),
    ("max_tokens", "16"), ("max_tokens", 16.0), ("max_tokens", True),
    ("min_tokens", -1), ("min_tokens", MAX_COUNT + 1), ("min_tokens", "1"), ("min_tokens", 1.0),
    ("logprobs", -1), ("logprobs", 21), ("logprobs", 2**63), ("logprobs", "1"), ("logprobs", False),
    ("seed", 2**64), ("seed", -(2**63) - 1), ("seed", 10**30), ("seed", -(10**30)), ("seed", "7"),
    ("seed", 1.5), ("seed", True),
    # sequences and flags
    ("stop", [""]), ("stop", [1]), ("stop", ["ok", None]), ("stop", 5),
    ("stop_token_ids", [-1]), ("stop_token_ids", ["1"]), ("stop_token_ids", [MAX_COUNT + 1]),
    ("stop_token_ids", [True]), ("stop_token_ids", 5), ("stop_token_ids", [2**64]),
    ("ignore_eos", "yes"), ("ignore_eos", 1), ("include_stop_str_in_output", None), ("skip_special_tokens", 0),
]


@pytest.mark.parametrize(("field", "value"), BAD, ids=[f"{f}={v!r}"[:40] for f, v in BAD])
def test_bad_values_are_param_errors_naming_the_field(field, value):
    with pytest.raises(ParamError) as e:
        SamplingParams(**{field: value})
    assert e.value.param == field
    assert len(str(e.value)) < 200  # a 400-digit number is not echoed back whole


def test_min_tokens_above_max_tokens_is_refused():
    with pytest.raises(ParamError) as e:
        SamplingParams(max_tokens=4, min_tokens=5)
    assert e.value.param == "min_tokens"
    assert SamplingParams(max_tokens=None, min_tokens=5).min_tokens == 5


GOOD = [
    ("temperature", 0.0, 0.0), ("temperature", 100.0, 100.0), ("temperature", 1, 1.0), ("temperature", 1e-6, 1e-6),
    ("top_p", 1e-9, 1e-9), ("top_p", 1.0, 1.0), ("min_p", 0.0, 0.0), ("min_p", 1.0, 1.0),
    ("presence_penalty", -2.0, -2.0), ("frequency_penalty", 2, 2.0),
    ("repetition_penalty", 0.01, 0.01), ("repetition_penalty", 100.0, 100.0),
    ("top_k", -1, -1), ("top_k", 0, 0), ("top_k", 1, 1), ("top_k", MAX_COUNT, MAX_COUNT),
    ("max_tokens", None, None), ("max_tokens", 1, 1), ("max_tokens", MAX_COUNT, MAX_COUNT),
    ("logprobs", 0, 0), ("logprobs", 20, 20),
    ("seed", 0, 0), ("seed", 2**63 - 1, 2**63 - 1), ("seed", -(2**63), -(2**63)),
    ("seed", 2**63, -(2**63)), ("seed", 2**64 - 1, -1),
    ("stop", "abc", ("abc",)), ("stop", ["a", "b"], ("a", "b")), ("stop_token_ids", [0, 7], (0, 7)),
]


@pytest.mark.parametrize(("field", "value", "stored"), GOOD, ids=[f"{f}={v!r}" for f, v, _ in GOOD])
def test_edge_values_are_accepted_and_normalised(field, value, stored):
    got = getattr(SamplingParams(**{field: value}), field)
    assert got == stored and type(got) is type(stored)


@pytest.mark.parametrize("seed", [0, 7, 2**32 + 5, 2**63 - 1, 2**63, 2**64 - 1, -1, -(2**63)])
def test_a_reduced_seed_gives_the_generator_of_the_original(seed):
    reduced = reduce_seed(seed)
    assert -(2**63) <= reduced < 2**63
    assert torch.Generator().manual_seed(seed).initial_seed() == torch.Generator().manual_seed(reduced).initial_seed()


def test_per_choice_seeds_wrap_instead_of_overflowing():
    # The server gives the k-th of n choices seed + k via dataclasses.replace (which re-validates).
    for top in (2**64 - 1, 2**63 - 1):
        p = SamplingParams(seed=top)
        nxt = dataclasses.replace(p, seed=p.seed + 1)
        assert nxt.seed == reduce_seed(top + 1)
        torch.Generator().manual_seed(nxt.seed)  # within what torch takes
    assert SamplingParams(seed=2**64 - 1).seed + 1 == 0


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, seed=2**64 - 1),
    SamplingParams(temperature=1.0, seed=-(2**63)),
    SamplingParams(temperature=1.0, top_k=MAX_COUNT),
    SamplingParams(temperature=1.0, top_k=MAX_COUNT, seed=3),
    SamplingParams(temperature=100.0, repetition_penalty=100.0),
    SamplingParams(temperature=1e-5, repetition_penalty=0.01, presence_penalty=2.0, frequency_penalty=-2.0),
    SamplingParams(temperature=1.0, top_p=1e-9, min_p=1.0),
])
def test_the_sampler_takes_every_accepted_extreme(params):
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.5, -1.0, 2.9], [30.0, -30.0, 0.0, 1.0, 2.0, 3.0]])
    reqs = [Request(f"r{i}", [1, 2], params) for i in range(2)]
    for r in reqs:
        r.output_token_ids = [1, 1]
    out = Sampler("cpu")(logits, reqs)
    assert all(0 <= t < 6 for t in out.token_ids)
