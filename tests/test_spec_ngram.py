"""spec/ngram.py: the prompt-lookup rule on hand-made sequences, the incremental index against a
brute-force scan on random sequences, and the per-request proposer."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from tandem.core import Request, SamplingParams
from tandem.spec.ngram import NgramIndex, NgramProposer, propose_ngram


def brute_force(context: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The rule written as a scan: for n from max_n down, the latest start of an earlier copy of
    the last n tokens (ending before the last token), and the up to k tokens after it."""
    length = len(context)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = list(context[length - n :])
        for start in range(length - n - 1, -1, -1):
            if list(context[start : start + n]) == suffix:
                return list(context[start + n : start + n + k])
    return []


# ---- the rule ----------------------------------------------------------------------------------


def test_longest_n_first_then_most_recent():
    assert propose_ngram([1, 2, 1, 3, 1], k=1, max_n=1) == [3]  # most recent earlier [1] is at 2
    # the 2-gram [7, 1] wins over the more recent 1-gram match of [1]
    assert propose_ngram([7, 1, 8, 1, 9, 7, 1], k=1, max_n=2) == [8]
    assert propose_ngram([7, 1, 8, 1, 9, 7, 1], k=1, max_n=1) == [9]
    # of two earlier [5, 6, 7], the later one; k tokens after it
    assert propose_ngram([5, 6, 7, 1, 2, 5, 6, 7, 3, 4, 0, 5, 6, 7], k=2, min_n=3, max_n=3) == [3, 4]


def test_fewer_than_k_tokens_available_and_overlapping_match():
    assert propose_ngram([1, 2, 1], k=4) == [2, 1]
    # [1, 1] ends at position 2, overlapping the suffix at 2..3: only one token follows it
    assert propose_ngram([1, 1, 1, 1], k=5, max_n=2) == [1]


def test_no_match_k_zero_and_short_contexts():
    assert propose_ngram([1, 2, 3], k=4) == []
    assert propose_ngram([1, 2, 3, 1], k=4, min_n=2) == []  # [3, 1] never seen; 1-grams not allowed
    assert propose_ngram([1, 2, 1], k=0) == []
    assert propose_ngram([], k=3) == [] and propose_ngram([4], k=3) == []
    with pytest.raises(ValueError, match="min_n"):
        propose_ngram([1, 2], k=1, min_n=3, max_n=2)
    with pytest.raises(ValueError, match="k must be >= 0"):
        propose_ngram([1, 2], k=-1)


# ---- the incremental index against the scan ----------------------------------------------------


@pytest.mark.parametrize("seed", range(8))
def test_incremental_index_equals_brute_force(seed):
    rng = random.Random(seed)
    min_n = rng.randint(1, 3)
    max_n = rng.randint(min_n, 5)
    vocab = rng.choice([2, 3, 5, 20])  # small vocabularies: many matches, of every n
    index = NgramIndex(min_n, max_n)
    context: list[int] = []
    for _ in range(150):
        chunk = [rng.randrange(vocab) for _ in range(rng.choice([0, 1, 1, 2, 5, 9]))]
        index.extend(chunk)
        context += chunk
        assert index.tokens == context
        for k in (0, 1, rng.randint(2, 12)):
            assert index.propose(k) == brute_force(context, k, min_n, max_n), (context, k, min_n, max_n)


def test_index_built_at_once_equals_grown_token_by_token():
    rng = random.Random(7)
    seq = [rng.randrange(6) for _ in range(400)]
    grown = NgramIndex(1, 4)
    for t in seq:
        grown.extend([t])
    whole = NgramIndex(1, 4, seq)
    assert grown._last == whole._last
    assert whole.propose(8) == brute_force(seq, 8, 1, 4)


# ---- the proposer ------------------------------------------------------------------------------


@dataclass
class _Req:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)


def test_proposer_per_request_k_and_incremental_catch_up():
    rng = random.Random(3)
    reqs = [_Req(str(i), [rng.randrange(4) for _ in range(50)]) for i in range(3)]
    proposer = NgramProposer(min_n=1, max_n=3)
    for step in range(40):
        ks = [rng.choice([0, 1, 3, 6]) for _ in reqs]
        drafts = [d.tokens for d in proposer.propose(reqs, ks)]
        for req, k, draft in zip(reqs, ks, drafts):
            assert draft == brute_force(req.prompt_token_ids + req.output_token_ids, k, 1, 3)
            req.output_token_ids += [rng.randrange(4) for _ in range(rng.randint(1, 4))]
    assert len(proposer) == 3
    proposer.remove("1")
    proposer.remove("missing")
    assert len(proposer) == 2


def test_proposer_k_zero_builds_nothing_and_shrunk_lists_rebuild():
    proposer = NgramProposer()
    req = _Req("a", [1, 2, 3, 1, 2])
    assert [d.tokens for d in proposer.propose([req], [0])] == [[]] and len(proposer) == 0
    assert [d.tokens for d in proposer.propose([req], [2])] == [[3, 1]]
    req.output_token_ids = [9, 1]  # grows: caught up
    assert [d.tokens for d in proposer.propose([req], [3])] == [[2, 9, 1]]  # [1] last seen at 3
    req.prompt_token_ids, req.output_token_ids = [4, 5, 4], []  # shorter than the index: rebuilt
    assert [d.tokens for d in proposer.propose([req], [3])] == [[5, 4]]
    with pytest.raises(ValueError, match="one k per request"):
        proposer.propose([req], [1, 2])


def test_proposer_reads_engine_requests():
    req = Request("r", [10, 11, 12, 10], SamplingParams(), output_token_ids=[11])
    assert NgramProposer(min_n=2, max_n=2).propose([req], [2])[0].tokens == [12, 10]
