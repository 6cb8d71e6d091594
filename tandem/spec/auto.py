"""`adaptive: "auto"`: the goodput controller's state across steps (`AutoK`), feeding the pure
search of `tandem.spec.goodput` with what each request's verifies showed.

One step, as `SpecDecoder` drives it:

1. `choose(ids, phases, limits)`: each request's K from its acceptance estimate (per position, per
   request, phase and context — whether its last draft was accepted whole — shrunk to the prior
   of that phase and context) and the step cost; the drafter then drafts to the batch's deepest K.
   A choice is reused for `REFRESH_STEPS` steps: per request and context, and under a padded
   cost (CUDA graphs) for the batch as a whole while its requests and phases stay; each search
   that finds the same depth again lets it stand twice as long, up to `HOLD_MAX` steps. Between
   searches a changed padded batch (requests coming, going, switching phase) takes the depth its
   phases and contexts weigh in for, with no search (`_batch_choice`). Such a batch's choice,
   and an all-zero one, then repeat without `choose` (`repeat`; the state is `tandem.spec.hold`'s)
   until a search or a probe falls due, each step cut to the requests' rooms (`within`);
   requests that finish leave the hold standing for the others, and requests that come join it
   where their phases keep its choice (`join_zero_hold`, `join_batch_hold`). A K a room cut
   (to 0 where no draft fits) is not the estimates' choice: it is neither held nor reused once
   the room grows (`_cuts`).
2. `refine(ids, confidences)`, for a drafter with a confidence head (DSpark): the drafts are cut
   where the drafter's own confidence, calibrated online against what verifies accepted, says the
   remaining tokens do not pay for their verify (the drafter's time is spent by then, so only the
   verify is charged).
3. `observe(id, num_draft, accepted)` per verified draft (the scheduler may have cut it) and
   `observe_step(ks, drafted, seconds)` with the step's measured time, which refines the cost.

A request whose K stayed the same for `PROBE_EVERY` steps drafts one captured depth deeper, once:
positions past K get no evidence, so an estimate that came out low on a few early rejections (or a
phase judged not worth drafting at all, K = 0) would never be looked at again. Likewise, while fewer
than `MIN_EVIDENCE` verifies of the phase (decayed, pooled over its requests) tried position K + 1,
every step probes it: two early rejections must not end drafting for good. Probes are spaced so that
they cost at most `PROBE_BUDGET` of the time (a probe that makes its step twice as slow waits
longer than one that adds 8%; a draft model's probe out of K = 0 also pays its catch-up over the
tokens it skipped, learned from the steps that did it); drafting is lossless, so a probe changes
speed only.

Predictions are kept for what the stats line and /metrics show against what happened: each
draft's expected accepted tokens, and each step's predicted seconds.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from tandem.spec.calibration import ConfidenceCalibration
from tandem.spec.goodput import (HYSTERESIS, AcceptanceStats, StepCost, choose_ks, depth_floors,
                                 expected_accepted, expected_curve)
from tandem.spec.hold import NOTHING, RUN, Hold, Pending, Visits

logger = logging.getLogger("tandem")

PROBE_EVERY = 16  # steps at one K after which a request drafts one captured depth deeper, once
PROBE_BUDGET = 0.01  # the share of step time probes may cost
CATCH_UP_SMOOTHING = 0.3
REFINE_MIN_GAIN = 0.05  # a confidence cut is tried when one verify token less saves this share
MIN_EVIDENCE = 8.0  # verifies of a phase that tried a position before K may stop short of it
REFRESH_STEPS = 8  # steps a request's choice in a context is reused before the batch is searched again
ZERO_HOLD_MAX = 64  # the longest an all-zero choice re-found for the same batch is held (see _zero_hold)
HOLD_MAX = 32  # the longest a choice that searches keep re-finding stands (see _search_batch)
MIX_MAX_BATCH = 2  # the largest batch whose padded choice is kept per mix of contexts (see _run_mix)


def _held_and_new(ids: Sequence[str], held: Sequence[str], new: Sequence[str]) -> bool:
    """Whether `ids` are exactly the `held` requests and the `new` ones, each once: what a
    request joining a hold needs (the held ones all still running, the new ones not held)."""
    together = {*held, *new}
    return len(ids) == len(held) + len(new) == len(together) and all(rid in together for rid in ids)


def _run_mix(keys: Sequence[str]) -> int:
    """How many of a batch's requests had their last draft accepted whole, for batches of up to
    MIX_MAX_BATCH (a single request's depth follows its context); larger batches average their
    requests' contexts, and their depth follows the phases alone (-1)."""
    if len(keys) > MIX_MAX_BATCH:
        return -1
    return sum(1 for key in keys if key.endswith(RUN))


class _BatchChoice(NamedTuple):
    """Under a padded cost, the ks kept for a batch (`AutoK._batch`)."""

    ids: tuple[str, ...] | None  # None once one of its requests was removed
    phases: tuple[str, ...]
    mix: int  # `_run_mix` of its requests' contexts
    ks: list[int]
    step: int  # of the search it came from: its age counts from there
    cuts: tuple[float, ...]  # the rooms its ks were cut to (`AutoK._cuts`)


@dataclass
class StepPrediction:
    """A step's predicted and measured seconds."""

    predicted: float
    measured: float


class AutoK:
    """The per-request K of `adaptive: "auto"` (see the module docstring)."""

    def __init__(self, max_k: int, depths: Sequence[int], cost: StepCost) -> None:
        self.max_k = max_k
        self.depths = tuple(sorted(set(depths)))
        self.cost = cost
        self.stats = AcceptanceStats(max_k)
        self.calibration = ConfidenceCalibration()
        self.visits = Visits()  # per request and statistics key: its K, steps at it, its draft's choice
        self.catch_up = 0.0  # learned: the extra seconds of a step whose drafter caught up (observe_catch_up)
        self._step = 0
        self._can_cut: dict[tuple[int, int, int], tuple[int, bool]] = {}  # see cut_can_pay
        self._priors: dict[str, tuple[int, list[float]]] = {}  # see _prior
        self._drafts_now: dict[tuple[str, int], tuple[int, bool]] = {}  # see drafts_now
        # id -> key -> (K, rates, step, steps it stands, the room it was cut to: `_cuts`) of the
        # last search that saw the request in that context
        self._choice: dict[str, dict[str, tuple[int, list[float], int, int, float]]] = {}
        # A choice repeats unchanged for more steps of the same requests (`repeat`): an all-zero
        # one, or a padded batch's choice, while no probe or search falls due.
        self.hold = Hold()
        # What the last `choose` drafted for, until `repeat` works out whether it holds (`_batch_hold`):
        # (ids, phases, keys, ks, ks before probes, limits).
        self._to_hold: tuple[list[str], list[str], list[str], list[int], list[int], list[int]] | None = None
        # Steps an all-zero choice may stand from the search that made it: REFRESH_STEPS, doubled
        # (up to ZERO_HOLD_MAX) each time a search finds all zero again, back to REFRESH_STEPS once
        # a search drafts. Not per batch: requests come and go (at 16, one every few steps), each
        # change searches at once, and what an all-zero finding rests on (the phases' estimates and
        # the step costs) does not move at K = 0, except by probes, which end a hold when due.
        self._zero_refresh = REFRESH_STEPS
        # Under a padded cost, the last search's ks for its batch (`_search_batch`, `_batch_choice`).
        self._batch: _BatchChoice | None = None
        # Steps it stands: REFRESH_STEPS, doubled (up to HOLD_MAX) each time a search of the
        # same batch finds the same ks again (`_search_batch`).
        self._batch_refresh = REFRESH_STEPS
        self._allowed = sorted({0, *self.depths})  # the depths a uniform batch may take
        # The largest allowed depth <= k, for k = 0 .. the deepest (a uniform depth within a room).
        self._fit = depth_floors(tuple(self._allowed))
        self._curves: dict[str, tuple[int, list[float]]] = {}  # key -> (its prior's step, E curve)
        self._uniform_costs: dict[int, tuple[int, list[float]]] = {}  # see _phase_ks
        # The next captured depth above each K (None above the deepest): what a probe tries.
        self._deeper = {k: next((d for d in self.depths if d > k), None) for k in range(max_k + 1)}

    def choose(self, ids: Sequence[str], phases: Sequence[str], limits: Sequence[int]) -> list[int]:
        """Each request's K for this step (0 .. its limit, from 0 and the captured depths)."""
        if not ids:  # a step of prompt work alone: nothing to choose, and no hold to end
            return []
        # The statistics are kept per phase and context: whether the request's last verify
        # accepted its whole draft (predictable text comes in runs: on the demo pair's DSpark
        # traces the first draft token is accepted 83% of the time after a full accept, 65% after
        # a rejection).
        visits = self.visits
        keys = [visits.key(rid, phase) for rid, phase in zip(ids, phases)]
        # Each request takes the choice last searched for it in its context while that search is
        # less than REFRESH_STEPS steps old: the estimates move by a few percent in that time,
        # and the search is most of the controller's host time per step (which a small GPU step
        # notices). A request without a fresh choice for its context (new, never searched in it
        # lately, or past its limit) makes the batch searched at once. The age is per context: a
        # batch whose requests switch context in step (all probing, then all after a rejection)
        # would otherwise search on one context's steps only and keep the other's first choice.
        self._step += 1
        self.hold.settle(visits)
        cached = [self._choice.get(rid, NOTHING).get(key) for rid, key in zip(ids, keys)]
        if all(c is not None and c[0] <= limit <= c[4] and self._step - c[2] < c[3]
               for c, limit in zip(cached, limits)):
            ks, rates = [c[0] for c in cached], [c[1] for c in cached]
            searched = [c[2] for c in cached]
        elif (batch := self._batch_choice(ids, phases, keys, limits)) is not None:
            # A padded step charges the batch's deepest K to every request, so the choice is the
            # batch's depth: it stands while the batch and its phases do (and for one or two
            # requests their contexts: `_run_mix`), for REFRESH_STEPS steps or more
            # (`_search_batch`), though single requests' contexts flip (one or another does
            # nearly every step at 4 and more, and a search every step cost ~0.1 ms of host time
            # at 16 on the H100 box's Xeon); a changed batch is weighed per phase and context
            # until the next search. A draft is predicted with the request's last searched rates
            # in its context (the phase's while it has none).
            ks, rates = batch, []
            searched = [self._batch.step] * len(ids)  # a request's context may not have been searched
            for c, key in zip(cached, keys):
                rates.append(self._prior(key) if c is None else c[1])
        else:
            priors = {key: self.stats.phase_rates(key) for key in set(keys)}  # once per key
            rates = [self.stats.rates(rid, key, priors[key]) for rid, key in zip(ids, keys)]
            previous = [visits.previous.get(rid, NOTHING).get(key, 0) for rid, key in zip(ids, keys)]
            ks = choose_ks(rates, self.depths, self.cost, previous, limits, self._hysteresis(previous))
            if any(ks):
                self._zero_refresh = REFRESH_STEPS
            cuts = self._cuts(ks, limits)
            for rid, key, k, r, cut in zip(ids, keys, ks, rates, cuts):
                choices = self._choice.get(rid)
                if choices is None:
                    choices = self._choice[rid] = {}
                old = choices.get(key)  # found again on enough evidence: it stands longer (_search_batch)
                life = (min(2 * old[3], HOLD_MAX) if old is not None and old[0] == k
                        and self.stats.request_tries(rid, key, 1) >= MIN_EVIDENCE else REFRESH_STEPS)
                choices[key] = (k, r, self._step, life, cut)
            if self.cost.uniform_is_optimal:
                self._search_batch(ids, phases, keys, ks, cuts)
            searched = [self._step] * len(ids)
        # Requests at K = 0 probe independently, each one making its step a drafting step (with
        # async scheduling a step that no longer goes ahead): each spaces its probes by their
        # number, so that together they keep to the budget.
        idle = max(1, ks.count(0))
        unprobed = list(ks)
        tries: dict[tuple[str, int], float] = {}  # phase_tries, once per key and position
        # Under a padded cost a probe's interval depends on (K, deeper) alone, until a probe
        # changes the batch's ks: once per pair (at 16 requests held at K = 0, every request asked).
        intervals: dict[tuple[int, int], float] = {}
        symmetric = self.cost.uniform_is_optimal
        for i, (rid, k) in enumerate(zip(ids, ks)):
            key = keys[i]
            prev, counts = visits.of(rid)
            same = counts.get(key, 0) + 1 if k == prev.get(key) else 1
            deeper = self._deeper[k]
            if deeper is not None and deeper <= limits[i]:
                evidence = tries.get((key, k))
                if evidence is None:
                    evidence = tries[(key, k)] = self.stats.phase_tries(key, k + 1)
                if evidence < MIN_EVIDENCE or (same >= PROBE_EVERY and same >= (idle if k == 0 else 1)
                                               * self._interval(ks, i, deeper, intervals if symmetric else None)):
                    ks[i], same = deeper, 0  # the next captured depth up, once
                    intervals.clear()
            counts[key] = same
            prev[key] = k  # the choice, not the probe: hysteresis compares with it
            if ks[i] == 0:  # no draft: the next step's context is no longer "after a rejection"
                visits.in_run[rid] = True
            visits.pending[rid] = Pending(phases[i], key, rates[i])
        # A batch's hold is worked out by the first `repeat` that asks (a synchronous step never does).
        self._to_hold = (list(ids), list(phases), keys, list(ks), unprobed, list(limits)) if any(ks) else None
        if not any(ks) and (hold := self._zero_hold(ids, keys, limits, idle, searched)):
            if searched[0] == self._step:  # all zero again, from a search just made (see _zero_refresh)
                self._zero_refresh = min(2 * self._zero_refresh, ZERO_HOLD_MAX)
            self.hold.set("zero", hold, ids, phases, keys, ks)
        return ks

    def _prior(self, key: str) -> list[float]:
        """The phase's rates (`AcceptanceStats.phase_rates`) for a request that takes a batch's
        choice without its own: what its draft is predicted on. Kept REFRESH_STEPS steps, as a
        choice is (they move by a few percent meanwhile): at 8-16 requests, with a new request
        every few steps, working them out for each one each step was a tenth of `choose`."""
        hit = self._priors.get(key)
        if hit is None or self._step - hit[0] >= REFRESH_STEPS:
            hit = self._priors[key] = (self._step, self.stats.phase_rates(key))
        return hit[1]

    def _hysteresis(self, previous: Sequence[int]) -> float:
        """The gain a search must find to replace `previous`: HYSTERESIS, and out of all-zero with a
        drafter that catches up on the tokens it skipped (a draft model), also the catch-up the
        first drafting step pays (`observe_catch_up`), spread over the REFRESH_STEPS steps a new
        choice stands at least. Live on the H100 box the draft model's drafting steps cost 2-7 ms
        of host time on top of the tables, against a 1-1.5 ms plain step at 8-16 requests, so a
        choice that pays by a few percent on the tables did not pay once it was made."""
        if self.catch_up <= 0.0 or any(previous):
            return HYSTERESIS
        return HYSTERESIS + self.catch_up / (REFRESH_STEPS * self.cost.seconds([0] * len(previous)))

    def _cuts(self, ks: Sequence[int], limits: Sequence[int]) -> tuple[float, ...]:
        """Per request, the room its K was cut to (inf: not cut, its estimates chose it). A K its
        room cut stands only while the room does not grow: near a request's end the room for the
        step after the one in flight is its room less that step's depth and token, so it swings
        from step to step; a K of 0 the rooms forced, held and reused as if chosen, kept the
        demo pair's last requests at K = 0 for steps on end (session 23: DSpark auto took 557
        steps ahead where K=7 took 525, at 16 requests on an H100 box)."""
        fit, top = self._fit, self._allowed[-1]
        return tuple(limit if k < top and limit < top and k == fit[limit] else math.inf
                     for k, limit in zip(ks, limits))

    def _search_batch(self, ids: Sequence[str], phases: Sequence[str], keys: Sequence[str], ks: Sequence[int],
                      cuts: tuple[float, ...]) -> None:
        """Keep a search's ks for its batch (under a padded cost). A search that finds the ks the
        batch already had lets them stand twice as long (up to HOLD_MAX steps), as a request's
        choice in a context does, once the estimates rest on MIN_EVIDENCE verifies (of the phase
        here, of the request there): then they move by a few percent in REFRESH_STEPS steps, and
        a search every REFRESH_STEPS steps was a fifth of what auto cost the host per step at 4
        requests (a third at 1: two contexts, each searched). A new request, a phase switch or a
        new depth searches at once, and the refresh starts again.

        For more than MIX_MAX_BATCH requests the same depth is what counts, whichever requests
        are in the batch: at 8-16 requests one comes or goes nearly every step, so a search of
        the very same batch never came twice, and its choice was never held (on the demo pair's
        DSpark traces at 16, `choose` ran at 150 of 159 steps ahead, session 23)."""
        batch = _BatchChoice(tuple(ids), tuple(phases), _run_mix(keys), list(ks), self._step, cuts)
        old = self._batch
        if old is None:
            same = False
        elif len(ids) > MIX_MAX_BATCH:
            same = len(old.phases) > MIX_MAX_BATCH and max(old.ks, default=0) == max(ks, default=0)
        else:
            same = old[:4] == batch[:4]  # the same requests, phases, mix and ks
        same = same and all(self.stats.phase_tries(key, 1) >= MIN_EVIDENCE for key in set(keys))
        self._batch_refresh = min(2 * self._batch_refresh, HOLD_MAX) if same else REFRESH_STEPS
        self._batch = batch

    def _batch_choice(self, ids: Sequence[str], phases: Sequence[str], keys: Sequence[str],
                      limits: Sequence[int]) -> list[int] | None:
        """Under a padded cost, the batch's ks without a search, or None (the caller searches):

        - the last search's ks, when it was made for this batch (the same requests in the same
          phases with the same mix of contexts) less than `_batch_refresh` steps ago and every K
          is still within its request's limit (and one its room cut, within the room it was cut
          to: `_cuts`);
        - for a changed batch (a request came or went, switched phase, or neared its end) of more
          than MIX_MAX_BATCH requests, less than REFRESH_STEPS steps after a search: the depth its
          phases and contexts weigh in for (`_phase_ks`).

        At 8-16 requests of ~100 tokens the batch changes nearly every step, and each change
        searched: on an H100 box at 16 requests DSpark auto searched at 349 of ~550 steps, and
        its `choose_ahead` took 0.20 ms of host time a step where K=7's took 0.04 (session 22).
        The search weighs each request's own rates; between searches a changed batch is weighed
        per phase and context, which is what a new request's rates are until it verifies. A
        copy: probes change it."""
        batch = self._batch
        if batch is None:
            return None
        age, ks = self._step - batch.step, batch.ks
        if (batch.ids == tuple(ids) and batch.phases == tuple(phases) and batch.mix == _run_mix(keys)
                and age < self._batch_refresh
                and all(k <= limit <= cut for k, limit, cut in zip(ks, limits, batch.cuts))):
            return list(ks)
        if age >= REFRESH_STEPS or len(ids) <= MIX_MAX_BATCH:
            return None
        ks = self._phase_ks(keys, limits, max(ks, default=0))
        # what `_search_batch` keeps, for this batch, from the same search (its age and refresh)
        self._batch = _BatchChoice(tuple(ids), tuple(phases), _run_mix(keys), ks, batch.step, self._cuts(ks, limits))
        return list(ks)

    def _phase_ks(self, keys: Sequence[str], limits: Sequence[int], last: int) -> list[int]:
        """The ks of the uniform depth (each request at most its limit) that a search would give a
        padded batch of requests in these contexts, each at its context's rates (`_prior`); `last`,
        the batch's depth so far, unless another beats it by the hysteresis a search asks.

        A padded step charges its depth to every request, so its goodput at a uniform depth is
        (n + the sum of its requests' E at that depth) / the step's seconds: one sum per context
        (count x its E), plus one term per request whose room is below the deepest depth."""
        n, allowed, fit, top = len(keys), self._allowed, self._fit, self._allowed[-1]
        gains = [0.0] * len(allowed)
        counts: dict[str, int] = {}
        capped = False
        for key, limit in zip(keys, limits):
            if limit >= top:
                counts[key] = counts.get(key, 0) + 1
                continue
            capped, curve = True, self._curve(key)
            for j, d in enumerate(allowed):
                gains[j] += curve[fit[min(d, limit)]]
        for key, count in counts.items():
            curve = self._curve(key)
            for j, d in enumerate(allowed):
                gains[j] += count * curve[d]
        if capped:  # the step's depth and its drafting requests depend on the rooms
            costs = [self.cost.seconds([fit[min(d, limit)] for limit in limits]) for d in allowed]
        else:
            hit = self._uniform_costs.get(n)
            if hit is None or self._step - hit[0] >= REFRESH_STEPS:  # the residuals move as slowly as the rates
                hit = self._uniform_costs[n] = (self._step, [self.cost.seconds([d] * n) for d in allowed])
            costs = hit[1]
        goodput = [(n + g) / c for g, c in zip(gains, costs)]
        best = max(range(len(allowed)), key=goodput.__getitem__)
        at_last = goodput[allowed.index(fit[min(last, top)])]
        depth = allowed[best] if goodput[best] > at_last * (1 + self._hysteresis([last] * n)) else last
        return [fit[min(depth, limit)] for limit in limits]

    def _curve(self, key: str) -> list[float]:
        """E(0) .. E(deepest) of a context at its prior (`_prior`), kept as long as the prior is."""
        rates = self._prior(key)
        at = self._priors[key][0]  # the step the prior was worked out at
        hit = self._curves.get(key)
        if hit is None or hit[0] != at:
            hit = self._curves[key] = (at, expected_curve(rates, self._allowed[-1]))
        return hit[1]

    def repeat(self, ids: Sequence[str]) -> list[int] | None:
        """The last choice again, when it holds for these requests (the same ones, within the
        steps it holds for): its ks (all zero, or a padded batch's choice); None: `choose`. Then the
        step is counted as chosen with no search and no phase tracking (a step that goes ahead at
        the device's pace notices the host time: at 16 requests on the H200 box's Xeon, auto's
        `choose_ahead` took 98 us a step where K=7's took 20, session 17). A phase switch during
        the hold is seen when it ends, within ZERO_HOLD_MAX (all zero) or HOLD_MAX (a batch's)
        steps: K changes speed only, never the tokens. Under a batch's hold each request's verify
        is still recorded under its current context (`Pending.key`), kept up to date here."""
        hold = self.hold
        if self._to_hold is not None:  # the last `choose` drafted: may its batch's choice be held?
            chosen_ids, phases, keys, ks, unprobed, limits = self._to_hold
            self._to_hold = None
            if chosen_ids == list(ids):
                left, due = self._batch_hold(chosen_ids, keys, ks, unprobed, limits)
                if left:
                    hold.set("batch", left, chosen_ids, phases, keys, ks, due)
        if not hold.matches(ids):
            return None
        if hold.kind == "batch" and not hold.step_batch(self.visits, self._choice):
            hold.left = 0
            return None
        self._take_held_step()
        return list(hold.ks)

    def within(self, ks: Sequence[int], limits: Sequence[int]) -> list[int]:
        """Held ks cut, each to the deepest captured depth within its request's room (`limits`)."""
        fit = self._fit
        return [k if k <= limit else fit[limit] for k, limit in zip(ks, limits)]

    def holds_zero(self, ids: Sequence[str]) -> bool:
        """Whether an all-zero hold with steps left stands for exactly these requests (in order)."""
        return self.hold.kind == "zero" and self.hold.matches(ids)

    def join_zero_hold(self, ids: Sequence[str], new: Sequence[str], phases: Sequence[str]) -> bool:
        """An all-zero hold goes on for `ids`: the requests it holds (those still running) and
        `new` ones (in `phases`), when no new request's phase would leave K = 0 in a batch this
        size (`drafts_now`, evidence included). Then no batch of them would: a padded step's
        goodput at a depth is the mean over its requests of (1 + E(depth)), each below what
        leaving zero needs (under a ragged cost the search behind `drafts_now` also tried one
        request drafting alone). True: one step of the hold is taken, for `ids` (in order)
        from now on. False, changing nothing: the caller chooses.

        Without it every request that came or went ended the hold, and the search that followed
        (the batch's phases, their step costs, its probes) took ~0.2 ms of host time on the H100
        box's Xeon: with a new request every few steps at 8 requests, 4-5% of a run at K = 0
        (session 21). A request leaving a hold keeps it for the others (`remove`)."""
        hold = self.hold
        if not hold.stands("zero") or not _held_and_new(ids, hold.ids, new):
            return False
        held = dict(zip(hold.ids, zip(hold.phases, hold.keys)))
        added = dict(zip(new, phases))
        if any(self.drafts_now(phase, len(ids)) for phase in set(phases)):
            return False
        left = hold.left
        hold.settle(self.visits)  # the held steps so far go to the requests held so far
        order = [held[rid] if rid in held else (added[rid], added[rid] + RUN) for rid in ids]
        hold.set("zero", left, ids, [phase for phase, _ in order], [key for _, key in order], [0] * len(ids))
        self._take_held_step()
        return True

    def zero_held(self) -> list[str] | None:
        """The requests an all-zero hold with steps left stands for (None: no such hold)."""
        return self.hold.ids if self.hold.stands("zero") else None

    def deepest_held(self) -> list[str] | None:
        """The requests a padded batch's hold at the deepest depth, with steps left, stands for
        (None: no such hold)."""
        hold = self.hold
        if not hold.stands("batch") or any(k != self._allowed[-1] for k in hold.ks):
            return None
        return hold.ids

    def join_batch_hold(self, ids: Sequence[str], new: Sequence[str], phases: Sequence[str]) -> list[int] | None:
        """A padded batch's hold at the deepest depth goes on for `ids`: the requests it holds
        (those still running) and `new` ones, when the batch's phases (`phases`, of every request
        in `ids`: held ones may have switched) and contexts weigh in for that depth (`_phase_ks`,
        the rule a changed batch follows between searches). At the deepest depth no request
        probes deeper, so nothing falls due. Returns the held ks, one step of the hold taken, for
        `ids` (in order) from now on (each to be cut to its request's room, `within`); None,
        changing nothing: the caller chooses.

        Why: DSpark at 8-16 requests drafts its deepest depth nearly every step, and the batch
        changes nearly every step; each change ended the hold, and the `choose` that followed
        (the phases tracked, each request's context, choice and probe) was most of what auto
        cost the host over K=7 (session 22). A request leaving keeps the hold for the others
        (`remove`)."""
        held_ids = self.deepest_held()
        if held_ids is None or len(ids) <= MIX_MAX_BATCH or not _held_and_new(ids, held_ids, new):
            return None
        top = self._allowed[-1]
        hold, visits = self.hold, self.visits
        left = hold.left
        added = set(new)
        keys = [visits.key(rid, phase) for rid, phase in zip(ids, phases)]
        if self._phase_ks(keys, [top] * len(ids), top) != [top] * len(ids):
            return None
        for rid, phase, key in zip(ids, phases, keys):
            if rid in added:
                visits.of(rid)
                visits.pending[rid] = Pending(phase, key, self._prior(key))
        hold.set("batch", left, ids, phases, keys, [top] * len(ids), [math.inf] * len(ids))
        if self._batch is not None:  # the search the hold came from stands for this batch now
            self._batch = _BatchChoice(tuple(ids), tuple(phases), _run_mix(keys), [top] * len(ids), self._batch.step,
                                       (math.inf,) * len(ids))
        hold.step_batch(visits, self._choice)  # at the deepest depth no probe falls due: it takes the step
        self._take_held_step()
        return list(hold.ks)

    def repeat_zero(self) -> bool:
        """One more step of an all-zero hold, for the batch it was set for: the caller vouches that
        the batch is unchanged (`SpecDecoder.repeat_zero`: the scheduler's running set is), so
        nothing is compared. False, changing nothing, when no all-zero hold stands (it ran out, a
        request left, or a choice replaced it)."""
        if not self.hold.stands("zero"):
            return False
        self._take_held_step()
        return True

    def _take_held_step(self) -> None:
        """A step of the hold, counted as chosen."""
        self.hold.take()
        self._step += 1

    def _batch_hold(self, ids: Sequence[str], keys: Sequence[str], ks: Sequence[int], unprobed: Sequence[int],
                    limits: Sequence[int]) -> tuple[int, list[float]]:
        """Steps a padded batch's choice would repeat unchanged (0: none), and each request's
        same-K steps at which its probe falls due: it was the batch's choice (`_batch`), re-found
        by a search at least once, and no probe changed it this step. It stands until the batch's
        own refresh falls due; a request's probe one captured depth deeper ends it on the step it
        falls due (`Hold.due`, checked by `Hold.step_batch`). A request nearing its end does not
        end it: each step cuts the held ks to the rooms (`within`), as any choice is; with 16
        requests of ~100 tokens one is within a deep draft of its end nearly every step. Not
        held: batches of one or two requests, whose choice follows their contexts (`_run_mix`),
        and a request whose phase has too little evidence for K + 1 in either context (it probes
        every step)."""
        batch = self._batch
        if (len(ids) <= MIX_MAX_BATCH or batch is None or batch.ids != tuple(ids) or list(ks) != list(unprobed)
                or self._batch_refresh <= REFRESH_STEPS):  # not re-found yet: the choice may still move
            return 0, []
        hold = self._batch_refresh - (self._step - batch.step) - 1
        if hold <= 0:
            return 0, []
        intervals: dict[tuple[int, int], float] = {}  # `_interval`'s memo (a padded cost: symmetric)
        evidence: dict[tuple[str, int], float] = {}  # (key, K) -> phase_tries, once each
        due = []
        for i, (key, k, limit) in enumerate(zip(keys, ks, limits)):
            deeper = self._deeper[k]
            if deeper is None or deeper > limit:
                due.append(math.inf)
                continue
            base = key[: -len(RUN)] if key.endswith(RUN) else key
            for context in (base, base + RUN):
                tries = evidence.get((context, k))
                if tries is None:
                    tries = evidence[(context, k)] = self.stats.phase_tries(context, k + 1)
                if tries < MIN_EVIDENCE:
                    return 0, []
            idle = max(1, list(ks).count(0)) if k == 0 else 1  # as `choose` spaces probes out of K = 0
            due.append(max(PROBE_EVERY, idle * self._interval(ks, i, deeper, intervals)))
        return hold, due

    def _zero_hold(self, ids: Sequence[str], keys: Sequence[str], limits: Sequence[int], idle: int,
                   searched: Sequence[int]) -> int:
        """Steps an all-zero choice just made would repeat unchanged: before the search it came
        from (searched[i]: the step of request i's, its own or the batch's) expires or a request's
        next probe falls due (0 while a phase lacks evidence: it probes; 0 for a request choosing
        after a rejection: at K = 0 its context changes next step; 0 for a request whose room
        admits no draft: its room may grow next step). A search that keeps finding
        all zero stands longer each time, whichever requests it is for (`_zero_refresh`): at K = 0 nothing
        new is verified, so the estimates it ran on move only with the step times and probes
        (which end a hold when due), and a search every REFRESH_STEPS steps was most of what a
        plain step costs the host on top of no speculation."""
        refresh = self._zero_refresh
        hold = refresh
        intervals: dict[int, float] = {}
        for rid, key, limit, at in zip(ids, keys, limits, searched):
            if not key.endswith(RUN):
                return 0
            hold = min(hold, refresh - 1 - (self._step - at))
            deeper = next((d for d in self.depths if 0 < d <= limit), None)
            if deeper is None:  # its room, not its estimates, kept it at K = 0 (see `_cuts`)
                return 0
            if self.stats.phase_tries(key, 1) < MIN_EVIDENCE:
                return 0
            if deeper not in intervals:
                intervals[deeper] = max(PROBE_EVERY, idle * self._probe_interval([0] * len(ids), 0, deeper))
            hold = min(hold, math.ceil(intervals[deeper] - self.visits.same_steps[rid][key]) - 1)
            if hold <= 0:
                return 0
        return max(hold, 0)

    def drafts_now(self, phase: str, batch: int) -> bool:
        """Whether a request starting in `phase` would draft in a batch of this size, from the
        phase's statistics (a phase with too little evidence yet counts as drafting: it would
        be probed). For a drafter that can skip work for requests kept at K = 0.

        Asked as a search out of all-zero asks it, with the gain that leaving K = 0 must make
        (`_hysteresis`: with a draft model, its catch-up too). Asked without it, a phase whose
        drafts pay on the tables by less than that was fed every prompt while the searches kept
        the batch at K = 0 (the draft model's prompt work for nothing, every new request). A
        request skipped here that does draft later catches up on its first draft, as after a
        hold at K = 0."""
        key = phase + RUN
        if self.stats.phase_tries(key, 1) < MIN_EVIDENCE:
            return True
        memo = (key, batch)
        hit = self._drafts_now.get(memo)
        # Kept as long as an all-zero choice stands (`_zero_refresh`: up to ZERO_HOLD_MAX steps while
        # searches keep finding all zero, REFRESH_STEPS once one drafts): at K = 0 nothing is
        # verified, so what it rests on moves only with the step costs and probes. Each request
        # that joins a batch held at K = 0 asks it (`join_zero_hold`).
        if hit is None or self._step - hit[0] >= self._zero_refresh:
            rates, zeros = self.stats.phase_rates(key), [0] * max(batch, 1)
            ks = choose_ks([rates] * len(zeros), self.depths, self.cost, zeros, hysteresis=self._hysteresis(zeros))
            hit = self._drafts_now[memo] = (self._step, any(ks))
        return hit[1]

    def _interval(self, ks: Sequence[int], i: int, deeper: int, memo: dict[tuple[int, int], float] | None) -> float:
        """`_probe_interval`, kept in `memo` by (K, deeper) when given."""
        if memo is None:
            return self._probe_interval(ks, i, deeper)
        got = memo.get((ks[i], deeper))
        if got is None:
            got = memo[(ks[i], deeper)] = self._probe_interval(ks, i, deeper)
        return got

    def _probe_interval(self, ks: Sequence[int], i: int, deeper: int) -> float:
        """Steps between probes, so that probing costs at most PROBE_BUDGET of the time: a probe
        that makes its step 8% slower (a GPU verify token) every PROBE_EVERY steps, one that
        doubles it (a drafter dearer than the target) every 100."""
        base = self.cost.seconds(ks)
        probe = self.cost.seconds([*ks[:i], deeper, *ks[i + 1 :]]) + (self.catch_up if ks[i] == 0 else 0.0)
        return (probe - base) / max(base, 1e-12) / PROBE_BUDGET

    def refine(self, ids: Sequence[str], drafted: Sequence[int], confidences: Sequence[Sequence[float] | None]
               ) -> list[int]:
        """Cut lengths of the drafts just made (drafted[i] tokens, confidences[i] the drafter's own
        estimate per token, None without one): the search rerun on the calibrated confidences,
        charging only the verify. Requests without a confidence keep their draft."""
        if not any(c is not None for c in confidences):
            return list(drafted)
        rates = []
        for rid, conf in zip(ids, confidences):
            pending = self.visits.pending[rid]
            if conf is not None:
                pending.confidence = list(conf)
                calibrated = [self.calibration.rate(pending.phase, c) for c in conf]
                pending.rates = calibrated + pending.rates[len(calibrated):]
            rates.append(pending.rates)
        ks = choose_ks(rates, self.depths, self.cost, limits=drafted, hysteresis=0.0, drafted=drafted)
        return [k if conf is not None else d for k, d, conf in zip(ks, drafted, confidences)]

    def cut_can_pay(self, drafted: Sequence[int]) -> bool:
        """Whether verifying one token less than the deepest draft saves more than REFINE_MIN_GAIN
        of the verify: reading the confidences is a host copy and a second search, which on a
        small GPU step (cheap verify tokens) costs more than any cut could save."""
        deepest = max(drafted, default=0)
        if deepest <= 0:
            return False
        key = (len(drafted), deepest, sum(1 for k in drafted if k))
        hit = self._can_cut.get(key)
        if hit is not None and self._step - hit[0] < REFRESH_STEPS:  # the cost moves slowly
            return hit[1]
        full = self.cost.seconds(drafted, drafted, include_draft=False)
        shorter = self.cost.seconds([min(k, deepest - 1) for k in drafted], drafted, include_draft=False)
        self._can_cut[key] = (self._step, full - shorter > REFINE_MIN_GAIN * full)
        return self._can_cut[key][1]

    def pending(self, request_id: str) -> Pending | None:
        """What the request's current draft was chosen on: a step ahead keeps it until it lands,
        when the next step's choice has replaced it (`expected` and `observe` take it back)."""
        return self.visits.pending.get(request_id)

    def expected(self, request_id: str, num_draft: int, pending: Pending | None = None) -> float:
        """The expected accepted tokens of the request's current draft (or of the one `pending`
        was chosen for) cut to num_draft."""
        pending = pending or self.visits.pending.get(request_id)
        return expected_accepted(pending.rates, num_draft) if pending is not None else 0.0

    def observe(self, request_id: str, num_draft: int, num_accepted: int, pending: Pending | None = None) -> float:
        """A verify of the request's draft (num_draft tokens, after any cut; chosen on `pending`,
        by default the current choice) accepted num_accepted. Returns the accepted tokens the
        choice expected of it (`expected`; 0 without a choice): one call per verify, each verify
        of each request makes one."""
        pending = pending or self.visits.pending.get(request_id)
        if pending is None or num_draft <= 0:
            return 0.0
        self.stats.observe(request_id, pending.key, num_draft, num_accepted)
        self.visits.in_run[request_id] = num_accepted == num_draft
        if pending.confidence is not None:
            self.calibration.observe(pending.phase, pending.confidence[:num_draft], num_accepted)
        return expected_accepted(pending.rates, num_draft)

    def observe_step(self, ks: Sequence[int], drafted: Sequence[int], seconds: float) -> StepPrediction:
        """A decode / verify step of these ks (the drafter having run at `drafted`) took `seconds`:
        returns what was predicted for it, then refines the cost."""
        return StepPrediction(self.cost.observe(ks, seconds, drafted), seconds)

    def observe_catch_up(self, ks: Sequence[int], drafted: Sequence[int], seconds: float) -> None:
        """A step in which the drafter first caught up on tokens it skipped (a draft model after
        steps at K = 0: an eager forward over them) took `seconds`: what it took beyond the
        model's prediction is what a probe out of K = 0 costs on top (`_probe_interval`), and
        what a choice to leave K = 0 must pay for (`_hysteresis`)."""
        extra = max(seconds - self.cost.seconds(ks, drafted), 0.0)
        self.catch_up = (1 - CATCH_UP_SMOOTHING) * self.catch_up + CATCH_UP_SMOOTHING * extra

    def remove(self, request_id: str) -> None:
        if self._batch is not None and self._batch.ids is not None and request_id in self._batch.ids:
            # A later request may reuse the id: the batch is no longer held or re-found by ids,
            # only weighed per phase for a changed batch (`_batch_choice`).
            self._batch = self._batch._replace(ids=None)
        # the others keep the hold for what is left of it (`join_zero_hold`, `join_batch_hold`)
        self.hold.drop(request_id, self.visits)
        self.stats.remove(request_id)
        self._choice.pop(request_id, None)
        self.visits.remove(request_id)
