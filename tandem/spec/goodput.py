"""The goodput controller's core (issue 15, `adaptive: "auto"`): each step, a draft depth K per
request that maximises the batch's expected tokens per second.

For request r drafting K tokens, the expected tokens it gets from one verify step are
1 + E_r(K), with E_r(K) = sum over i <= K of a_r1 * ... * a_ri, where a_ri is the probability that
draft position i is accepted given that positions 1 .. i-1 were (the conditional acceptance).
The step costs T(ks): the predicted time of the verify step and the drafter's forwards for this
batch and these K's (`StepCost`). The controller picks ks maximising
G(ks) = sum_r (1 + E_r(K_r)) / T(ks), over the depths that have a captured graph.

- Acceptance (`AcceptanceStats`): per-position accept / reject counts, per request and per phase,
  with a shared prior per phase (from every request of that phase, the method's history), and an
  exponential decay. A verify of K drafts with m accepted is evidence for positions 1 .. m+1
  (accepted up to m, rejected at m+1 when m < K); deeper positions were not tried. The decay
  (`DECAY` per verify, a half-life of ~24 verifies) lets a request's estimate follow it when its
  text changes character (a phase's second half is not its first), while 24 verifies of 1-4
  positions are enough evidence to move off the prior. The prior's pseudo-counts (`PRIOR_WEIGHT`)
  make a new request start from its phase's statistics, not from zero.
- Cost: `StepCost` is a table of measured step times by (batch bucket, query length); a batch
  that mixes depths runs padded to its longest (the runner's graphs are keyed that way), so the
  cost depends on the largest K in the batch. A hook (`extra`) adds what the table cannot know
  (with experts on the CPU: the distinct experts a step's tokens route to).
- Search: coordinate ascent from the best of the previous step's ks and every uniform depth
  (each request's K moved to every allowed depth in turn, improvements kept, until none improves
  G; the uniform starts matter because a padded step makes a lone drafter pay for the batch),
  then hysteresis: the new ks replace the previous ones only if G improves by more than
  `HYSTERESIS`, so K does not flap on noise.
  K = 0 wins when drafting costs more time than it saves tokens (e.g. at high concurrency, where
  a verify token is no longer nearly free).

This module is pure (no engine, no tensors). Not wired yet: `SpecDecoder.choose_k` still serves
`off` and `phase`; `auto` needs it fed with each verify's (K, accepted) per request and phase, the
table measured from the captured graphs at start-up, and the realised step times.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

DECAY = 0.97  # per verify: a half-life of log(0.5) / log(0.97) ~ 23 verifies
PRIOR_WEIGHT = 4.0  # pseudo-observations of the phase prior in each request's estimate
HYSTERESIS = 0.02  # relative goodput gain needed to change the batch's ks
DEFAULT_ACCEPT = 0.5  # a phase nothing has been seen of yet


@dataclass
class _Counts:
    """Decayed accept and try counts per draft position (index 0: position 1)."""

    accepted: list[float] = field(default_factory=list)
    tried: list[float] = field(default_factory=list)

    def add(self, num_draft: int, num_accepted: int, decay: float) -> None:
        self.accepted = [a * decay for a in self.accepted]
        self.tried = [t * decay for t in self.tried]
        reached = min(num_accepted + 1, num_draft)  # positions the verify tells something about
        while len(self.tried) < reached:
            self.accepted.append(0.0)
            self.tried.append(0.0)
        for i in range(reached):
            self.tried[i] += 1.0
            if i < num_accepted:
                self.accepted[i] += 1.0

    def rate(self, i: int, prior: float, weight: float) -> float:
        """The conditional acceptance of position i+1, shrunk towards `prior` by `weight`."""
        a = self.accepted[i] if i < len(self.accepted) else 0.0
        t = self.tried[i] if i < len(self.tried) else 0.0
        return (a + weight * prior) / (t + weight)


class AcceptanceStats:
    """Per-position conditional acceptance, per request and per phase (see the module docstring)."""

    def __init__(self, max_k: int, decay: float = DECAY, prior_weight: float = PRIOR_WEIGHT) -> None:
        self.max_k = max_k
        self.decay = decay
        self.prior_weight = prior_weight
        self._phase: dict[str, _Counts] = {}
        self._request: dict[tuple[str, str], _Counts] = {}

    def observe(self, request_id: str, phase: str, num_draft: int, num_accepted: int) -> None:
        if num_draft <= 0:
            return
        if not 0 <= num_accepted <= num_draft:
            raise ValueError(f"accepted {num_accepted} of {num_draft} drafts")
        self._phase.setdefault(phase, _Counts()).add(num_draft, num_accepted, self.decay)
        self._request.setdefault((request_id, phase), _Counts()).add(num_draft, num_accepted, self.decay)

    def remove(self, request_id: str) -> None:
        for key in [k for k in self._request if k[0] == request_id]:
            del self._request[key]

    def phase_rates(self, phase: str) -> list[float]:
        """The phase prior: a_1 .. a_Kmax over every request seen in this phase. A position no
        request reached yet takes the deepest position's rate seen (acceptance falls with depth,
        so that is optimistic only by the untried drop)."""
        counts = self._phase.get(phase)
        if counts is None:
            return [DEFAULT_ACCEPT] * self.max_k
        rates = []
        for i in range(self.max_k):
            prior = rates[-1] if rates else DEFAULT_ACCEPT
            rates.append(counts.rate(i, prior, 1.0))
        return rates

    def rates(self, request_id: str, phase: str) -> list[float]:
        """a_1 .. a_Kmax for one request in its phase: its own counts shrunk to the phase prior."""
        prior = self.phase_rates(phase)
        counts = self._request.get((request_id, phase))
        if counts is None:
            return prior
        return [counts.rate(i, prior[i], self.prior_weight) for i in range(self.max_k)]


def expected_accepted(rates: Sequence[float], k: int) -> float:
    """E(K) = sum over i <= K of a_1 * ... * a_i: the expected accepted drafts of K."""
    total, run = 0.0, 1.0
    for a in rates[:k]:
        run *= a
        total += run
    return total


@dataclass
class StepCost:
    """Predicted seconds of one step, from measured times by (batch bucket, query length q = 1 + K)
    of the verify step and the drafter (`times`; the table's buckets and depths are what was
    captured). A batch runs at the smallest bucket holding it and the longest q in it (mixed depths
    are padded). `extra(ks)` adds what the table cannot know (CPU experts: the distinct experts of
    a step's tokens). `observe` refines an entry online with the measured time of a real step."""

    times: dict[tuple[int, int], float]
    extra: Callable[[Sequence[int]], float] | None = None
    smoothing: float = 0.1

    def __post_init__(self) -> None:
        if not self.times:
            raise ValueError("StepCost needs at least one measured (bucket, q) time")
        self._buckets = sorted({b for b, _ in self.times})

    def bucket(self, batch: int) -> int:
        i = bisect.bisect_left(self._buckets, batch)
        if i == len(self._buckets):
            raise ValueError(f"no captured batch bucket holds {batch} requests (largest {self._buckets[-1]})")
        return self._buckets[i]

    def seconds(self, ks: Sequence[int]) -> float:
        key = (self.bucket(len(ks)), 1 + max(ks, default=0))
        if key not in self.times:
            raise ValueError(f"no measured step time for batch bucket {key[0]} at query length {key[1]}")
        return self.times[key] + (self.extra(ks) if self.extra else 0.0)

    def observe(self, ks: Sequence[int], seconds: float) -> None:
        key = (self.bucket(len(ks)), 1 + max(ks, default=0))
        old = self.times.get(key, seconds)
        self.times[key] = (1 - self.smoothing) * old + self.smoothing * seconds


def goodput(rates: Sequence[Sequence[float]], ks: Sequence[int], cost: StepCost) -> float:
    """Expected tokens per second of one step: sum_r (1 + E_r(K_r)) / T(ks)."""
    tokens = sum(1.0 + expected_accepted(r, k) for r, k in zip(rates, ks))
    return tokens / cost.seconds(ks)


def choose_ks(
    rates: Sequence[Sequence[float]],
    depths: Sequence[int],
    cost: StepCost,
    previous: Sequence[int] | None = None,
    limits: Sequence[int] | None = None,
    hysteresis: float = HYSTERESIS,
) -> list[int]:
    """The ks (one per request) maximising `goodput`, each from `depths` (0 and the captured
    depths) and at most the request's limit (what it may still generate). Coordinate ascent from
    `previous` (or all 0); the result replaces `previous` only when it is better by more than
    `hysteresis` (relative)."""
    n = len(rates)
    allowed = sorted({0, *depths})
    caps = list(limits) if limits is not None else [allowed[-1]] * n

    def fit(k: int, cap: int) -> int:  # the largest allowed depth <= min(k, cap)
        return max(d for d in allowed if d <= min(k, cap))

    start = [fit(k, c) for k, c in zip(previous, caps)] if previous is not None and len(previous) == n else [0] * n
    ks, best = list(start), goodput(rates, start, cost)
    # Moving one request at a time cannot leave all-0 where the padded step makes one drafter pay
    # for everyone: every uniform depth is a starting point too.
    for d in allowed:
        uniform = [fit(d, c) for c in caps]
        g = goodput(rates, uniform, cost)
        if g > best * (1 + 1e-9):
            ks, best = uniform, g
    improved = True
    while improved:
        improved = False
        for r in range(n):
            for d in allowed:
                if d > caps[r] or d == ks[r]:
                    continue
                trial = ks[:r] + [d] + ks[r + 1 :]
                g = goodput(rates, trial, cost)
                if g > best * (1 + 1e-9):
                    ks, best, improved = trial, g, True
    if previous is not None and len(previous) == n and best <= goodput(rates, start, cost) * (1 + hysteresis):
        return start
    return ks


def hand_cost(per_q: Mapping[int, Mapping[int, float]]) -> StepCost:
    """A StepCost from {bucket: {q: seconds}} (tests, replayed traces)."""
    return StepCost({(b, q): t for b, row in per_q.items() for q, t in row.items()})
