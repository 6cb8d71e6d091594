"""What `AutoK` keeps per request between steps (`Visits`) and the choice it repeats without a
search (`Hold`): state and its bookkeeping only. When a hold is set, for how long, and who may
join it are the controller's decisions (`tandem.spec.auto`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

RUN = "+run"  # the statistics' key suffix of a request whose last draft was accepted whole

NOTHING: dict = {}  # a default for lookups of requests not seen yet (never written)


@dataclass(slots=True)
class Pending:
    """What a request's current draft was chosen on (one made per request and step: slots)."""

    phase: str
    key: str  # the statistics' key: the phase and the context (see `Visits.key`)
    rates: list[float]  # a_1 .. a_Kmax the choice used (calibrated confidence where refined)
    confidence: list[float] | None = None


class Visits:
    """Each request's history under auto, per statistics key (its phase and its context: whether
    its last verify accepted the whole draft): the K chosen there last (what hysteresis compares
    with), how many visits in a row chose it (what probes count), and what its current draft was
    chosen on (`Pending`, what its verify is recorded under)."""

    def __init__(self) -> None:
        self.previous: dict[str, dict[str, int]] = {}
        self.same_steps: dict[str, dict[str, int]] = {}
        self.in_run: dict[str, bool] = {}
        self.pending: dict[str, Pending] = {}

    def key(self, request_id: str, phase: str) -> str:
        """The request's statistics key in `phase`: a request not verified yet counts as in a run."""
        return phase + (RUN if self.in_run.get(request_id, True) else "")

    def of(self, request_id: str) -> tuple[dict[str, int], dict[str, int]]:
        """The request's (K chosen last, steps at it) per key, made empty for a new request."""
        prev = self.previous.get(request_id)
        if prev is None:  # (get, not setdefault: no dict built per request per step)
            prev = self.previous[request_id] = {}
            self.same_steps[request_id] = {}
        return prev, self.same_steps[request_id]

    def remove(self, request_id: str) -> None:
        self.previous.pop(request_id, None)
        self.same_steps.pop(request_id, None)
        self.in_run.pop(request_id, None)
        self.pending.pop(request_id, None)


class Hold:
    """A choice that repeats unchanged for `left` more steps of the same requests, in order
    (`ids`, each in `phases` under `keys`, at `ks`): an all-zero one (`kind` "zero") or a padded
    batch's ("batch"). A batch's hold counts each request's steps at its K as it takes them
    (`step_batch`) and ends on the step a request's probe falls due (`due`, in same-K steps); an
    all-zero hold adds its steps to its requests' counts when it is settled (`settle`)."""

    def __init__(self) -> None:
        self.left = 0
        self.kind = "zero"
        self.ids: list[str] = []
        self.phases: list[str] = []
        self.keys: list[str] = []
        self.ks: list[int] = []
        self.due: list[float] = []
        self._taken = 0  # an all-zero hold's steps not yet added to the same-K counts

    def set(self, kind: str, left: int, ids: Sequence[str], phases: Sequence[str], keys: Sequence[str],
            ks: Sequence[int], due: Sequence[float] | None = None) -> None:
        self.kind, self.left = kind, left
        self.ids, self.phases, self.keys, self.ks = list(ids), list(phases), list(keys), list(ks)
        self.due = list(due) if due is not None else []  # an all-zero hold has none

    def stands(self, kind: str) -> bool:
        """Whether a hold of this kind has steps left."""
        return self.left > 0 and self.kind == kind

    def matches(self, ids: Sequence[str]) -> bool:
        """Whether a hold with steps left stands for exactly these requests (in order)."""
        return self.left > 0 and list(ids) == self.ids

    def take(self) -> None:
        """One step of the hold."""
        self.left -= 1
        if self.kind == "zero":
            self._taken += 1

    def settle(self, visits: Visits) -> None:
        """The all-zero hold's steps so far go to its requests' same-K counts; the hold ends."""
        if self._taken:
            for rid, key in zip(self.ids, self.keys):
                counts = visits.same_steps.get(rid)
                if counts is not None and key in counts:
                    counts[key] += self._taken
            self._taken = 0
        self.left = 0

    def step_batch(self, visits: Visits, searched: dict[str, dict[str, tuple]]) -> bool:
        """A held batch's step, with the bookkeeping `AutoK.choose`'s per-request loop does: each
        request's context this step, its steps at its K in that context, its choice there, and
        the context its verify will be recorded under (`Pending.key`, with the rates last
        searched for it there, `searched[id][key][1]`, where there are some). False, changing
        nothing, when a request's probe falls due this step (the caller chooses)."""
        steps = []
        for rid, phase, k, due in zip(self.ids, self.phases, self.ks, self.due):
            key = visits.key(rid, phase)
            counts, prev = visits.same_steps[rid], visits.previous[rid]
            same = counts.get(key, 0) + 1 if prev.get(key) == k else 1
            if same >= due:
                return False
            steps.append((rid, phase, k, key, counts, prev, same))
        for rid, phase, k, key, counts, prev, same in steps:
            counts[key] = same
            prev[key] = k
            if k == 0:
                visits.in_run[rid] = True
            pending = visits.pending[rid]  # made by the `choose` that set the hold
            if pending.key != key:
                choice = searched.get(rid, NOTHING).get(key)
                visits.pending[rid] = Pending(phase, key, choice[1] if choice is not None else pending.rates)
        return True

    def drop(self, request_id: str, visits: Visits) -> None:
        """A held request finished: the others keep the hold for what is left of it."""
        if not self.left or request_id not in self.ids:
            return
        left = self.left
        self.settle(visits)
        i = self.ids.index(request_id)
        for held in (self.ids, self.phases, self.keys, self.ks, *((self.due,) if self.kind == "batch" else ())):
            del held[i]
        self.left = left if self.ids else 0
