"""Prompt-lookup (n-gram) drafting: propose the tokens that followed an earlier occurrence of the
context's last n tokens.

The rule (the common prompt-lookup rule): take the last n tokens of the context (prompt + output so
far), for n from `max_n` down to `min_n`; find the most recent *earlier* occurrence of that n-gram
(one that ends before the context's last token; it may overlap the suffix itself); propose the up
to k tokens that followed it (fewer when the context ends sooner). The longest n that has a match
wins, even over a more recent match of a shorter n. No match for any n -> no draft ([]).

`NgramIndex` applies the rule to one growing sequence in O(max_n) per step instead of a scan of
the context: for each n it keeps a dict from n-gram to the end position of its most recent
occurrence, updated as tokens are appended. The n-grams that end at the last token are indexed
only when the next token arrives, so a lookup of the current suffix finds an earlier occurrence,
never the suffix itself. `NgramProposer` holds one index per request for the engine;
`propose_ngram` applies the rule once to a list.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from tandem.spec.proposer import Draft


def _check_n(min_n: int, max_n: int) -> None:
    if not 1 <= min_n <= max_n:
        raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")


class NgramIndex:
    """The prompt-lookup rule over one sequence that only grows (see the module docstring).

    `extend` costs O(max_n) dict updates per appended token, done in C through dict.update (a
    32K-token prompt indexes in about 8 ms); a step — extend by the kept tokens, then propose — is
    a few microseconds at any context length (max_n - min_n + 1 dict probes and a copy of at most
    k tokens). Memory: one dict entry per distinct n-gram per n, about 120 bytes per token of
    context on real text with n in 1..3 and 350 at most (every n-gram distinct).
    """

    def __init__(self, min_n: int = 1, max_n: int = 3, token_ids: Sequence[int] = ()) -> None:
        _check_n(min_n, max_n)
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        # _last[n - min_n][ngram] = end position of its most recent occurrence that ends before the
        # last token; keys are token ids for n = 1 and tuples of n ids otherwise.
        self._last: list[dict] = [{} for _ in range(min_n, max_n + 1)]
        self.extend(token_ids)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, token_ids: Sequence[int]) -> None:
        """Append tokens to the sequence."""
        if not token_ids:
            return
        start = len(self.tokens)  # first appended position
        toks = self.tokens
        toks.extend(token_ids)
        last = len(toks) - 1  # n-grams ending here wait for the next token
        for n, table in zip(range(self.min_n, self.max_n + 1), self._last):
            # newly indexable: n-grams ending at start - 1 (the old suffix) .. last - 1
            lo = max(start - 1, n - 1)
            if lo >= last:
                continue
            ends = range(lo, last)
            if n == 1:
                table.update(zip(toks[lo:last], ends))
            else:  # columns of the n-grams ending at lo .. last - 1, zipped into tuples
                cols = [toks[lo - n + 1 + j : last - n + 1 + j] for j in range(n)]
                table.update(zip(zip(*cols), ends))  # a later occurrence overwrites: most recent wins

    def propose(self, k: int) -> list[int]:
        """Up to k tokens by the rule; [] for k = 0 or no match."""
        if k <= 0:
            if k < 0:
                raise ValueError(f"a draft of k={k} tokens: k must be >= 0")
            return []
        toks = self.tokens
        length = len(toks)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            key = toks[-1] if n == 1 else tuple(toks[length - n :])
            end = self._last[n - self.min_n].get(key)
            if end is not None:
                return toks[end + 1 : end + 1 + k]
        return []


def propose_ngram(token_ids: Sequence[int], k: int, min_n: int = 1, max_n: int = 3) -> list[int]:
    """The rule applied once to `token_ids` (builds an index: O(len) — for a sequence that grows
    step by step keep an `NgramIndex` instead)."""
    _check_n(min_n, max_n)
    if k == 0:
        return []
    return NgramIndex(min_n, max_n, token_ids).propose(k)


class SpecRequest(Protocol):
    """What a proposer reads of a request (`tandem.core.Request` has it)."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]


class NgramProposer:
    """Prompt-lookup drafts for a batch of requests, one `NgramIndex` per request.

    `propose(requests, ks)` catches each index up with the tokens its request gained since the last
    call (its prompt and output token lists are read, never concatenated), then proposes up to
    `ks[i]` tokens; k = 0 skips the request (no index is built for a request that never drafts).
    A request's token lists must only grow; if they are shorter than the index (tokens removed)
    the index is rebuilt. Call `remove(request_id)` when a request finishes or is aborted.
    """

    def __init__(self, min_n: int = 1, max_n: int = 3) -> None:
        _check_n(min_n, max_n)
        self.min_n, self.max_n = min_n, max_n
        self._indexes: dict[str, NgramIndex] = {}

    def propose(self, requests: Sequence[SpecRequest], ks: Sequence[int]) -> list[Draft]:
        if len(requests) != len(ks):
            raise ValueError(f"propose needs one k per request, got {len(ks)} for {len(requests)} requests")
        return [Draft(self._index(req).propose(k) if k > 0 else []) for req, k in zip(requests, ks)]

    def observe(self, batch: Sequence[object], kept: Sequence[int], aux: object) -> None:
        """Nothing to do: the indexes catch up with the requests' token lists in `propose`."""

    def remove(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._indexes)

    def _index(self, req: SpecRequest) -> NgramIndex:
        prompt, output = req.prompt_token_ids, req.output_token_ids
        index = self._indexes.get(req.request_id)
        if index is None or len(index) > len(prompt) + len(output):
            index = self._indexes[req.request_id] = NgramIndex(self.min_n, self.max_n)
        have = len(index)
        if have < len(prompt):
            index.extend(prompt[have:])
            have = len(prompt)
        if have < len(prompt) + len(output):
            index.extend(output[have - len(prompt) :])
        return index
