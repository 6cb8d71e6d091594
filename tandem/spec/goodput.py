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
- Cost (`StepCost`): measured target step times by (batch bucket, query length) and drafter
  times by (bucket, depth), plus what real steps add on top (host work), learned online. With
  CUDA graphs a batch that mixes depths runs padded to its longest, so the cost depends on the
  largest K in the batch; eager steps are ragged and cost by their total tokens. A hook (`extra`)
  adds what the tables cannot know (with experts on the CPU: the distinct experts a step's tokens
  route to).
- Search (`choose_ks`): every uniform depth (each request at min(depth, its limit)); under a
  padded cost that is the optimum (a request drafting less saves nothing: it is padded), else
  coordinate ascent from the best (each request's K moved to every allowed depth in turn,
  improvements kept, until none improves G). Then hysteresis: the new ks replace the previous
  ones only if G improves by more than `HYSTERESIS`, so K does not flap on noise. K = 0 wins when
  drafting costs more time than it saves tokens (e.g. at high concurrency, where a verify token
  is no longer nearly free).

This module is pure (no engine, no tensors); `tandem.spec.auto` holds the per-request state that
feeds it, and `SpecDecoder` wires that into the engine.
"""

from __future__ import annotations

import bisect
import functools
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

DECAY = 0.97  # per verify of the request: a half-life of log(0.5) / log(0.97) ~ 23 verifies
# Per verify of any request of the phase: the prior pools every request (16 a step at concurrency
# 16), so it forgets by verifies, not steps: a half-life of ~700 verifies.
PHASE_DECAY = 0.999
PRIOR_WEIGHT = 4.0  # pseudo-observations of the phase prior in each request's estimate
HYSTERESIS = 0.02  # relative goodput gain needed to change the batch's ks
DEFAULT_ACCEPT = 0.5  # a phase nothing has been seen of yet
OUTLIER_FACTOR = 2.0  # a measured step counts as at most this many times its predicted time
# A learned residual can be negative (the tables were measured on a busy machine, real steps are
# faster), and it is shared by every depth of a bucket: added to a cheaper step's modelled time it
# could predict a step taking no time, or less. A prediction never drops below this share of the
# tables' time.
MIN_MODELLED_SHARE = 0.25
# With async scheduling, plain steps observed before this many are taken as no dearer than the
# device's time: the few plain steps a drafting batch makes (between probes, after a prefill) are
# not what a run of them costs, and an estimate from them can keep K = 0 from being tried at all.
MIN_PLAIN_STEPS = 32


class _Counts:
    """Decayed verify outcomes of one request or phase, as two histograms: `reached[j]`, the
    weight of verifies whose evidence reached draft position j + 1 (they tried positions 1 .. j + 1),
    and `accepted[j]`, of verifies that accepted exactly j + 1 drafts. Position i + 1 was tried by
    sum(reached[i:]) and accepted by sum(accepted[i:]) of them: a verify adds to one entry of
    each (every verify of every request lands here, 16 a step at concurrency 16), and the sums are
    made when an estimate is read, which a search does every few steps.

    Stored scaled: the true decayed weights are `reached[j] / scale`, `accepted[j] / scale`. Each
    observation divides the decay into `scale` and adds `scale`, which ages every older count by
    one decay without touching it."""

    __slots__ = ("accepted", "reached", "scale")

    def __init__(self, size: int) -> None:
        self.accepted = [0.0] * size
        self.reached = [0.0] * size
        self.scale = 1.0

    def add(self, num_draft: int, num_accepted: int, decay: float) -> None:
        self.scale /= decay
        if self.scale > 1e12:  # renormalise long before a float runs out
            self.accepted = [a / self.scale for a in self.accepted]
            self.reached = [t / self.scale for t in self.reached]
            self.scale = 1.0
        reached = min(num_accepted + 1, num_draft)  # positions the verify tells something about
        if reached > len(self.reached):  # deeper than the size it was made for
            grow = [0.0] * (reached - len(self.reached))
            self.accepted += grow
            self.reached += grow
        self.reached[reached - 1] += self.scale
        if num_accepted:
            self.accepted[num_accepted - 1] += self.scale

    def suffixes(self) -> tuple[list[float], list[float]]:
        """(accepted, tried) per position, scaled: the histograms' suffix sums."""
        return (list(accumulate(reversed(self.accepted)))[::-1], list(accumulate(reversed(self.reached)))[::-1])

    def tries(self, i: int) -> float:
        return sum(self.reached[i:]) / self.scale

    def rates(self, prior: Sequence[float], weight: float) -> list[float]:
        """The conditional acceptance of each position of `prior`, shrunk towards it by `weight`."""
        ws = weight * self.scale
        accepted, tried = self.suffixes()
        out = [(a + ws * p) / (t + ws) for a, t, p in zip(accepted, tried, prior)]
        out += [(ws * p) / ws for p in prior[len(out):]]  # positions past the histograms: never tried
        return out


class AcceptanceStats:
    """Per-position conditional acceptance, per request and per phase (see the module docstring)."""

    def __init__(self, max_k: int, decay: float = DECAY, prior_weight: float = PRIOR_WEIGHT,
                 phase_decay: float = PHASE_DECAY) -> None:
        self.max_k = max_k
        self.decay = decay
        self.phase_decay = phase_decay
        self.prior_weight = prior_weight
        self._phase: dict[str, _Counts] = {}
        self._request: dict[str, dict[str, _Counts]] = {}  # request id -> phase -> counts

    def observe(self, request_id: str, phase: str, num_draft: int, num_accepted: int) -> None:
        if num_draft <= 0:
            return
        if not 0 <= num_accepted <= num_draft:
            raise ValueError(f"accepted {num_accepted} of {num_draft} drafts")
        # get, not setdefault: a default argument would build two lists per call (every verify
        # of every request lands here)
        counts = self._phase.get(phase)
        if counts is None:
            counts = self._phase[phase] = _Counts(self.max_k)
        counts.add(num_draft, num_accepted, self.phase_decay)
        per_request = self._request.get(request_id)
        if per_request is None:
            per_request = self._request[request_id] = {}
        counts = per_request.get(phase)
        if counts is None:
            counts = per_request[phase] = _Counts(self.max_k)
        counts.add(num_draft, num_accepted, self.decay)

    def remove(self, request_id: str) -> None:
        self._request.pop(request_id, None)

    def phase_rates(self, phase: str) -> list[float]:
        """The phase prior: a_1 .. a_Kmax over every request seen in this phase. A position no
        request reached yet takes the deepest position's rate seen (acceptance falls with depth,
        so that is optimistic only by the untried drop)."""
        counts = self._phase.get(phase)
        if counts is None:
            return [DEFAULT_ACCEPT] * self.max_k
        accepted, tried = counts.suffixes()
        rates, prior = [], DEFAULT_ACCEPT
        for i in range(self.max_k):
            a, t = (accepted[i], tried[i]) if i < len(tried) else (0.0, 0.0)
            prior = (a + counts.scale * prior) / (t + counts.scale)
            rates.append(prior)
        return rates

    def phase_tries(self, phase: str, position: int) -> float:
        """The decayed number of verifies of this phase that tried draft position `position`
        (1-based): how much evidence its rate rests on."""
        counts = self._phase.get(phase)
        return counts.tries(position - 1) if counts is not None else 0.0

    def request_tries(self, request_id: str, phase: str, position: int) -> float:
        """`phase_tries` of one request's own verifies."""
        counts = self._request.get(request_id, {}).get(phase)
        return counts.tries(position - 1) if counts is not None else 0.0

    def rates(self, request_id: str, phase: str, prior: Sequence[float] | None = None) -> list[float]:
        """a_1 .. a_Kmax for one request in its phase: its own counts shrunk to the phase prior
        (`prior`: `phase_rates(phase)`, when the caller has it)."""
        prior = self.phase_rates(phase) if prior is None else prior
        counts = self._request.get(request_id, {}).get(phase)
        if counts is None:
            return prior
        return counts.rates(prior[: self.max_k], self.prior_weight)


def expected_curve(rates: Sequence[float], top: int) -> list[float]:
    """[E(0), E(1), .. E(top)]: `expected_accepted` at every depth up to `top`, in one pass."""
    return list(accumulate(accumulate(rates[:top], operator.mul), initial=0.0))


def expected_accepted(rates: Sequence[float], k: int) -> float:
    """E(K) = sum over i <= K of a_1 * ... * a_i: the expected accepted drafts of K."""
    total, run = 0.0, 1.0
    for a in rates[:k]:
        run *= a
        total += run
    return total


def _interp(points: Sequence[tuple[float, float]], x: float) -> float:
    """Piecewise-linear through `points` (x, t), sorted by x, at x; beyond the ends, the nearest segment's line
    (one point: its value). Used where a table has no entry: a batch bucket not measured, a token
    count between measured shapes."""
    pts = points  # sorted by x
    if len(pts) == 1:
        return pts[0][1]
    i = min(max(bisect.bisect_left([p[0] for p in pts], x), 1), len(pts) - 1)
    (x0, t0), (x1, t1) = pts[i - 1], pts[i]
    return t0 + (t1 - t0) * (x - x0) / (x1 - x0) if x1 != x0 else t1


def _with_residual(modelled: float, learned: float) -> float:
    return max(modelled + learned, MIN_MODELLED_SHARE * modelled)


@dataclass
class StepCost:
    """Predicted seconds of one step for per-request draft depths ks.

    verify: measured target step times by (batch bucket, query length q = 1 + K), from the runner's
        graphs or eager forwards at start-up (`ModelRunner.measure`).
    draft: measured drafter times by (bucket of the requests drafting, depth); empty for a drafter
        that costs only host time (n-gram lookup).
    padded: True when steps replay CUDA graphs: a batch runs at the smallest bucket holding it and
        the longest q in it (the runner pads mixed depths), so only max(ks) matters. False for
        eager steps, which pack ragged queries: the cost is read off the measured (batch, q) grid
        at the batch size and the mean query length (interpolated, extrapolated past its edges).
    extra(ks): what the tables cannot know (CPU experts: the distinct experts a step's tokens
        route to), added to every prediction.
    plain_overlaps: steps without drafts run with async scheduling: their host work overlaps the
        device's, so what a drafting step's host work costs says nothing about theirs (below).

    What the tables miss in a real step — host work (scheduling, sampling, detokenizing), longer
    contexts than the measuring shapes, a drafter's per-forward Python — is learned online:
    `observe` keeps an exponential average (`smoothing`) of measured minus modelled seconds per
    bucket and whether the drafter ran. Not per query length: host work hardly depends on it (the
    tables carry what does), and a per-q estimate rests on the few steps that visited that q, so
    one slow step could make a depth look dear for good.
    """

    verify: dict[tuple[int, int], float]
    draft: dict[tuple[int, int], float] = field(default_factory=dict)
    padded: bool = True
    buckets: tuple[int, ...] = ()
    extra: Callable[[Sequence[int]], float] | None = None
    smoothing: float = 0.1
    plain_overlaps: bool = False

    def __post_init__(self) -> None:
        if not self.verify:
            raise ValueError("StepCost needs at least one measured (bucket, q) time")
        if not self.buckets:
            self.buckets = tuple(sorted({b for b, _ in self.verify}))
        self._by_q: dict[int, list[tuple[float, float]]] = {}
        for (b, q), t in sorted(self.verify.items()):
            self._by_q.setdefault(q, []).append((b, t))
        self._draft_by_depth: dict[int, list[tuple[float, float]]] = {}
        for (b, d), t in sorted(self.draft.items()):
            self._draft_by_depth.setdefault(d, []).append((b, t))
        # modelled() by (batch, q, the drafter's depth, its requests' bucket), or for a ragged cost
        # (-batch, the query tokens, the drafter's depth, its requests): the tables never change, and
        # the controller asks for the same few shapes every step (without a hook).
        self._memo: dict[tuple[int, int, int, int], float] = {}
        self.residual: dict[tuple[int, bool], float] = {}  # (bucket, drafter ran) -> learned seconds
        self.observed: dict[tuple[int, bool], int] = {}  # steps the residual learned from
        self._bucket_of = [self.buckets[bisect.bisect_left(self.buckets, n)] for n in range(self.buckets[-1] + 1)]

    @property
    def uniform_is_optimal(self) -> bool:
        """Whether every request drafting the batch's depth (within its limit) is optimal: a padded
        step charges the longest query to everyone, so a shorter K saves nothing."""
        return self.padded and self.extra is None

    def bucket(self, batch: int) -> int:
        if batch >= len(self._bucket_of):  # every step asks: a table, not a search
            raise ValueError(f"no captured batch bucket holds {batch} requests (largest {self.buckets[-1]})")
        return self._bucket_of[batch]

    def modelled(self, ks: Sequence[int], drafted: Sequence[int] | None = None, include_draft: bool = True) -> float:
        """The tables' seconds for a step verifying ks, the drafter having run for `drafted` (its
        requests' depths; default ks), without the learned residual."""
        if self.extra is not None:
            return self._modelled(ks, drafted, include_draft)
        drafted = ks if drafted is None else drafted
        depth = max(drafted, default=0) if include_draft else 0
        drafting = len(drafted) - drafted.count(0) if depth else 0
        if self.padded:
            key = (len(ks), max(ks, default=0), depth, self.bucket(drafting) if depth else 0)
        else:  # ragged: the verify depends on the mean query length, the drafter on its request count
            key = (-len(ks), sum(ks), depth, drafting)
        t = self._memo.get(key)
        if t is None:
            t = self._memo[key] = self._modelled(ks, drafted, include_draft)
        return t

    def _modelled(self, ks: Sequence[int], drafted: Sequence[int] | None, include_draft: bool) -> float:
        n, q = len(ks), 1 + max(ks, default=0)
        if self.padded:
            points = self._by_q.get(q)
            if points is None:
                raise ValueError(f"no measured step time at query length {q} (measured {sorted(self._by_q)})")
            t = self.verify.get((self.bucket(n), q))
            t = _interp(points, self.bucket(n)) if t is None else t
        else:  # ragged: the measured grid at (n, the mean query length), bilinear
            t = _interp([(qq, _interp(self._by_q[qq], n)) for qq in sorted(self._by_q)], 1 + sum(ks) / max(n, 1))
        drafted = ks if drafted is None else drafted
        if include_draft and self._draft_by_depth and any(drafted):
            depth, count = max(drafted), sum(1 for k in drafted if k > 0)
            at = self.bucket(count) if self.padded else count
            d = self.draft.get((at, depth))
            if d is None:
                points = self._draft_by_depth.get(depth)
                if points is None:
                    raise ValueError(f"no measured drafter time at depth {depth} (measured {sorted(self._draft_by_depth)})")
                d = _interp(points, at)
            t += d
        return t + (self.extra(ks) if self.extra else 0.0)

    def _residual_key(self, ks: Sequence[int], drafted: Sequence[int] | None) -> tuple[int, bool]:
        return self.bucket(len(ks)), any(ks if drafted is None else drafted)

    def known(self, batch: int, drafting: bool) -> bool:
        """Whether steps of `batch` requests (drafting or not) refined the residual MIN_PLAIN_STEPS
        times: from then on a sample of them keeps it (the engine times one in HELD_STEPS_TIMED)."""
        return batch > 0 and self.observed.get((self.bucket(batch), drafting), 0) >= MIN_PLAIN_STEPS

    def learned(self, ks: Sequence[int], drafted: Sequence[int] | None = None) -> float:
        """The learned host seconds of a step like this (see the class docstring). A kind of step
        not seen yet in its bucket takes the other kind's: most host work is the same with or
        without a drafter, and 0 would make the unseen kind look free. Except a plain step under
        async scheduling (`plain_overlaps`): it runs at the device's pace as far as is known (0),
        which makes the controller try K = 0 and learn its real cost, where the drafting steps'
        host work would keep it from ever trying; and so it stays until MIN_PLAIN_STEPS plain
        steps were seen (the estimate learns meanwhile)."""
        bucket, drafting = self._residual_key(ks, drafted)
        learned = self.residual.get((bucket, drafting))
        if self.plain_overlaps and not drafting and self.observed.get((bucket, False), 0) < MIN_PLAIN_STEPS:
            return min(learned or 0.0, 0.0)  # see MIN_PLAIN_STEPS
        if learned is not None:
            return learned
        return self.residual.get((bucket, not drafting), 0.0)

    def seconds(self, ks: Sequence[int], drafted: Sequence[int] | None = None, include_draft: bool = True) -> float:
        """Predicted seconds of the step (see `modelled`), with what was learned online; always
        positive (`MIN_MODELLED_SHARE`)."""
        return _with_residual(self.modelled(ks, drafted, include_draft), self.learned(ks, drafted))

    def observe(self, ks: Sequence[int], seconds: float, drafted: Sequence[int] | None = None) -> float:
        """A real step verifying ks (drafted at `drafted`) took `seconds`: refine the residual.
        Returns what was predicted for it."""
        modelled = self.modelled(ks, drafted)
        key = self._residual_key(ks, drafted)
        old = self.learned(ks, drafted)
        predicted = _with_residual(modelled, old)
        # One slow step (a page fault, a long stall) counts as at most OUTLIER_FACTOR times the
        # prediction: a persistent change is still learned within a few dozen steps (each may
        # double the estimate), an outlier is not frozen into the estimate.
        err = min(seconds, OUTLIER_FACTOR * predicted) - modelled
        learned = self.residual.get(key)
        if learned is None:  # start from the value used so far (another kind's, or 0)
            learned = old
        self.residual[key] = (1 - self.smoothing) * learned + self.smoothing * err
        self.observed[key] = self.observed.get(key, 0) + 1
        return predicted

    def table(self) -> str:
        """The measured verify (and drafter) times in ms, one line per bucket: for the start-up log."""
        qs = sorted(self._by_q)
        lines = ["batch " + " ".join(f"{'q=' + str(q):>8}" for q in qs)]
        for b in sorted({b for b, _ in self.verify}):
            lines.append(f"{b:>5} " + " ".join(f"{self.verify[(b, q)] * 1e3:8.3f}" if (b, q) in self.verify
                                               else f"{'-':>8}" for q in qs))
        if self.draft:
            depths = sorted(self._draft_by_depth)
            lines.append("drafter " + " ".join(f"{'d=' + str(d):>8}" for d in depths))
            for b in sorted({b for b, _ in self.draft}):
                lines.append(f"{b:>7} " + " ".join(f"{self.draft[(b, d)] * 1e3:8.3f}" if (b, d) in self.draft
                                                   else f"{'-':>8}" for d in depths))
        return "\n".join(lines)


def goodput(rates: Sequence[Sequence[float]], ks: Sequence[int], cost: StepCost) -> float:
    """Expected tokens per second of one step: sum_r (1 + E_r(K_r)) / T(ks)."""
    tokens = sum(1.0 + expected_accepted(r, k) for r, k in zip(rates, ks))
    return tokens / cost.seconds(ks)


@functools.cache
def depth_floors(allowed: tuple[int, ...]) -> tuple[int, ...]:
    """For k = 0 .. the deepest allowed depth, the largest allowed depth <= k."""
    return tuple(max(d for d in allowed if d <= k) for k in range(allowed[-1] + 1))


def choose_ks(
    rates: Sequence[Sequence[float]],
    depths: Sequence[int],
    cost: StepCost,
    previous: Sequence[int] | None = None,
    limits: Sequence[int] | None = None,
    hysteresis: float = HYSTERESIS,
    drafted: Sequence[int] | None = None,
) -> list[int]:
    """The ks (one per request) maximising `goodput`, each from `depths` (0 and the captured
    depths) and at most the request's limit (what it may still generate, or the length of the
    draft it has). Candidates: every uniform depth (each request at min(depth, its limit)), then,
    when the cost is not padded (`StepCost.uniform_is_optimal`), coordinate ascent from the best.
    The result replaces `previous` only when it is better by more than `hysteresis` (relative).

    `drafted`: the drafter already ran at these depths this step (a draft being cut after its
    confidence was read): its time is spent, so only the verify is charged."""
    n = len(rates)
    allowed = sorted({0, *depths})
    caps = list(limits) if limits is not None else [allowed[-1]] * n
    # expected[r][k] = E_r(k) for every k up to the deepest allowed depth.
    expected = [expected_curve(r, allowed[-1]) for r in rates]
    spent = drafted is not None

    def g(ks: Sequence[int]) -> float:
        tokens = n + sum(expected[r][k] for r, k in enumerate(ks))
        return tokens / cost.seconds(ks, drafted, include_draft=not spent)

    top = allowed[-1]
    floor = depth_floors(tuple(allowed))

    def fit(k: int, cap: int) -> int:  # the largest allowed depth <= min(k, cap)
        return floor[min(k, cap, top)]

    have_previous = previous is not None and len(previous) == n
    start = [fit(k, c) for k, c in zip(previous, caps)] if have_previous else [0] * n
    ks, best = list(start), g(start)
    start_g = best
    uncapped = all(c >= top for c in caps)
    # Every uniform depth: with no request capped below the deepest depth, the batch's expected
    # tokens at depth d are one column sum (this runs every step for every batch size).
    column = [n + sum(col) for col in zip(*expected)] if uncapped and n else None
    for d in allowed:
        uniform = [d] * n if uncapped else [fit(d, c) for c in caps]
        if column is not None:
            gu = column[d] / cost.seconds(uniform, drafted, include_draft=not spent)
        else:
            gu = g(uniform)
        if gu > best * (1 + 1e-9):
            ks, best = uniform, gu
    improved = not cost.uniform_is_optimal
    while improved:
        improved = False
        for r in range(n):
            for d in allowed:
                if d > caps[r] or d == ks[r]:
                    continue
                trial = ks[:r] + [d] + ks[r + 1 :]
                gt = g(trial)
                if gt > best * (1 + 1e-9):
                    ks, best, improved = trial, gt, True
    if have_previous and best <= start_g * (1 + hysteresis):
        return start
    return ks


def hand_cost(per_q: Mapping[int, Mapping[int, float]], **kwargs: Any) -> StepCost:
    """A padded StepCost from {bucket: {q: seconds}} (tests, replayed traces)."""
    return StepCost({(b, q): t for b, row in per_q.items() for q, t in row.items()}, **kwargs)
