"""Speculative steps that go ahead: draft, verify and accept on the device, the host one step behind.

A synchronous speculative step waits for the host twice: the drafts must reach the host before
the verify is staged, and the accepted counts before the next draft. On a small target those
waits and the host work between them are most of a step (the demo pair: ~0.45 ms of device
work in a ~1 ms step). A step ahead is launched while its predecessor is still in flight and
needs nothing from it on the host; everything that depends on what the predecessor accepted is
computed on the device, queued behind it:

1. each request's query starts where the predecessor's kept tokens end: the host stages the
   step as if nothing was accepted and the device shifts positions, lengths and slots by the
   accepted count (`ModelRunner.execute_ahead`);
2. DSpark drafts a block from the window of hidden states ending there, after the token the
   predecessor added (its correction or bonus token), read on the device
   (`DSparkProposer.draft_ahead`);
3. the verify graph replays, and greedy acceptance runs on the device (`accept_on_device`);
4. the kept rows' hidden states go into the ring (`DSparkProposer.observe_ahead`);
5. the accepted counts, the tokens and the drafts are copied to pinned host memory.

Then the host lands the predecessor (`SpecAhead.land`): tokens appended and checked for stops
exactly as a synchronous step appends them, the computed counts advanced, the KV blocks trimmed
to what is kept plus what the step in flight may still write, the controller told what each
draft got. A request that the landed tokens stop has a wasted row in the step in flight, dropped
when that step lands.

KV: a step ahead allocates slots for the largest outcome of the step before it (every draft
accepted) plus its own query; what the outcome leaves unused is given back at landing.

What goes ahead (`SpecAhead.eligible`): a batch of decoding requests only (no prefill, nobody
waiting to be admitted), each greedy without penalties or logprobs (acceptance is an argmax
comparison), without a grammar, with its DSpark window in the ring, and with room for the step
in flight's largest outcome before its max_tokens or the context ends. Anything else lands the
step in flight and runs the synchronous step. The proposer must draft on the device (DSpark);
the model's KV groups must be plain paged attention (`unsupported` says why not, once).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tandem.core import Request, RequestStatus
from tandem.engine.inflight import InFlightStep
from tandem.engine.runner import ModelRunner
from tandem.engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from tandem.engine.static_inputs import host_to_device
from tandem.kv.manager import KVCacheManager
from tandem.spec.controller import SpecDecoder
from tandem.spec.verify import VerifyResult, is_plain_greedy


def accept_on_device(logits: torch.Tensor, drafts: torch.Tensor | None, ks: torch.Tensor, q: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification of N requests at once, on the device. logits [N * q, V]: request i's
    q rows (its 1 + ks[i] query tokens, then pads); drafts [N, >= q - 1] (None when q = 1).
    Returns (accepted [N] int64, tokens [N, q] int64): request i keeps drafts[i, :accepted[i]]
    followed by tokens[i, accepted[i]], the target's argmax there (the correction, or the bonus
    token after every draft); tokens[i, :accepted[i]] are those drafts. The same rule as
    `accept_greedy`, on the same rows."""
    n = ks.shape[0]
    target = logits.view(n, q, -1).argmax(dim=-1)  # [N, q]
    if q == 1:
        return torch.zeros(n, dtype=torch.int64, device=logits.device), target
    assert drafts is not None
    proposed = drafts[:, : q - 1]
    live = torch.arange(q - 1, device=logits.device) < ks[:, None]  # [N, q - 1]: real drafts
    accepted = ((proposed == target[:, :-1]) & live).long().cumprod(dim=1).sum(dim=1)  # [N]
    tokens = torch.cat([proposed, target[:, -1:]], dim=1)
    tokens.scatter_(1, accepted[:, None], target.gather(1, accepted[:, None]))
    return accepted, tokens


@dataclass
class SpecAheadStep:
    """A speculative step launched ahead (see the module docstring); its results on their way to
    the host. `starts` are exact once the step before it has landed (`SpecAhead.land` shifts them)."""

    requests: list[Request]
    starts: list[int]  # each request's first query position
    ks: list[int]  # drafts verified per request
    pendings: list[object | None]  # what auto chose each K on (SpecDecoder.pending_choices)
    host: torch.Tensor  # [N, columns] the results' rows (SpecAhead's layout), pinned on CUDA
    copied: torch.cuda.Event | None
    chained: bool  # launched ahead of another step in flight
    index: dict[str, int] = field(default_factory=dict)  # request id -> row

    def __post_init__(self) -> None:
        self.index = {r.request_id: i for i, r in enumerate(self.requests)}


class SpecAhead:
    """Launches and lands speculative steps ahead for one engine (its runner, KV manager,
    scheduler and speculative stage). It keeps the last step's results on the device, one row per
    request (`results`: accepted count, last token, the tokens, the drafts), which the next step
    reads (`before`) and overwrites (`after`): with graphs, the whole step is one replay
    (`ModelRunner.execute_ahead`)."""

    def __init__(self, runner: ModelRunner, kv: KVCacheManager, scheduler: Scheduler, spec: SpecDecoder,
                 max_num_seqs: int) -> None:
        self.runner, self.kv, self.scheduler, self.spec = runner, kv, scheduler, spec
        self.proposer = spec.proposer
        self.max_num_seqs = max_num_seqs
        self.device = runner.device
        kmax = spec.config.num_speculative_tokens
        self.max_q = 1 + kmax
        # Row r: [accepted, last token, tokens (max_q), drafts (kmax)]; row max_num_seqs stays 0.
        self.results = torch.zeros(max_num_seqs + 1, 2 + self.max_q + kmax, dtype=torch.int64, device=self.device)
        self.zero_row = max_num_seqs
        self._tokens_at, self._drafts_at = 2, 2 + self.max_q

    @staticmethod
    def unsupported(spec: SpecDecoder, kv: KVCacheManager) -> str | None:
        """Why speculative steps cannot go ahead with this proposer and model, or None."""
        if not spec.can_draft_ahead:
            return f"the {spec.config.method} proposer drafts on the host"
        kinds = {g.spec.kind for g in kv.groups}
        if kinds != {"full"}:
            return f"the model's KV cache has {sorted(kinds - {'full'})} groups (positions move on the host)"
        window = getattr(spec.proposer, "window", 0)
        if spec.config.num_speculative_tokens + 1 > window:
            return f"num_speculative_tokens + 1 exceeds the DSpark window {window}"
        return None

    # -- around the target's forward (ModelRunner.execute_ahead; a graph captures these) -----------
    def depth(self, q: int) -> int:
        return next(d for d in self.proposer.depths if d >= q - 1) if q > 1 else 0  # a captured block depth

    def before(self, start: torch.Tensor, slot: torch.Tensor, pick: torch.Tensor, depth: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Each request's shift and first token from the predecessor's row `pick`, its first
        position, and DSpark's drafts from the ring window ending there."""
        prev = self.results.index_select(0, pick)
        shift, known = prev[:, 0], prev[:, 1]
        base = start + shift
        drafts = self.proposer.draft_from_ring(slot, base, known, depth) if depth else None
        return shift, known, drafts, base

    def after(self, q: int, logits: torch.Tensor, aux: torch.Tensor | None, drafts: torch.Tensor | None,
              ks: torch.Tensor, slot: torch.Tensor, base: torch.Tensor) -> None:
        """Accept, keep the kept rows' hidden states in the ring, write the results' rows."""
        if aux is None:
            raise RuntimeError("a DSpark step ahead needs the target runner's aux-layer outputs")
        accepted, tokens = accept_on_device(logits, drafts, ks, q)
        self.proposer.observe_ahead(slot, base, accepted, aux, q)
        n, out = ks.shape[0], self.results
        out[:n, 0].copy_(accepted)
        out[:n, 1].copy_(tokens.gather(1, accepted[:, None]).view(-1))
        out[:n, self._tokens_at : self._tokens_at + q].copy_(tokens)
        if drafts is not None:
            out[:n, self._drafts_at : self._drafts_at + q - 1].copy_(drafts[:, : q - 1])

    # -- planning ---------------------------------------------------------------------------------
    def eligible(self, prev: InFlightStep | SpecAheadStep | None) -> list[Request] | None:
        """The requests a step ahead of `prev` (None: no step in flight) would run: every running
        request, when each qualifies (module docstring); else None."""
        sched = self.scheduler
        running = sched.running
        if not running or (sched.waiting and len(running) < self.max_num_seqs):
            return None
        if isinstance(prev, SpecAheadStep):
            rows = prev.index
        elif isinstance(prev, InFlightStep):
            rows = {s.request.request_id: i for i, s in enumerate(s for s in prev.sched.scheduled if s.samples)}
        else:
            rows = None
        for req in running:
            if rows is not None and req.request_id not in rows:
                return None
            if rows is None and req.num_computed_tokens != req.num_tokens - 1:
                return None  # prefill work left
            if req.params.grammar is not None or not is_plain_greedy(req) or not self.proposer.ready_ahead(req):
                return None
            ahead = prev.ks[prev.index[req.request_id]] + 1 if isinstance(prev, SpecAheadStep) else int(rows is not None)
            if self.spec.room(req) < ahead:
                return None  # the step in flight may end it
        return list(running)

    def in_flight_drafts(self, reqs: list[Request], prev: InFlightStep | SpecAheadStep | None) -> list[int]:
        """Drafts the step in flight verifies for each request (0 for a plain step or none)."""
        if not isinstance(prev, SpecAheadStep):
            return [0] * len(reqs)
        return [prev.ks[prev.index[r.request_id]] for r in reqs]

    # -- launch -----------------------------------------------------------------------------------
    def launch(self, reqs: list[Request], ks: list[int], prev: InFlightStep | SpecAheadStep | None,
               pendings: list[object | None]) -> tuple[SpecAheadStep, str] | None:
        """Queue a step ahead of `prev` (see the module docstring); returns it and how it ran
        (`ForwardOutput.mode`). None, launching nothing, when a request's slots do not fit (the
        synchronous step then preempts)."""
        behind = self.in_flight_drafts(reqs, prev)
        # The first query position as if `prev` accepted nothing: a step ahead's requests did not
        # advance at its launch (they advance when it lands); a plain step's did.
        starts = [r.num_computed_tokens + (1 if isinstance(prev, SpecAheadStep) else 0) for r in reqs]
        for i, (req, start, b, k) in enumerate(zip(reqs, starts, behind, ks)):
            # Through position start + b + k: the step in flight's largest outcome, then this query.
            if not self.kv.allocate_slots(req, start + b + k + 1 - req.num_computed_tokens):
                for done, d in zip(reqs[:i], behind):  # give back what this launch took: the in flight step's stays
                    self.kv.trim(done, done.num_computed_tokens + (d + 1 if isinstance(prev, SpecAheadStep) else 0))
                return None
        n = len(reqs)
        if isinstance(prev, SpecAheadStep):
            picks = [prev.index[r.request_id] for r in reqs]
        else:  # the results' rows start from the plain step's sampled tokens, or the host's last tokens
            if isinstance(prev, InFlightStep):
                sampled = {s.request.request_id: i for i, s in enumerate(s for s in prev.sched.scheduled if s.samples)}
                picks = [sampled[r.request_id] for r in reqs]
                last = prev.tokens
            else:
                picks = list(range(n))
                last = host_to_device([r.all_token_ids[-1] for r in reqs], torch.int64, self.device)
            self.results[: len(last), 0].zero_()
            self.results[: len(last), 1].copy_(last)
        meta = {"start": starts, "ks": list(ks), "slot": self.proposer.ring_slots(reqs), "pick": picks}
        batch = [ScheduledRequest(r, s, 1 + k, True, (0,) * k, input_row=i)
                 for i, (r, s, k) in enumerate(zip(reqs, starts, ks))]
        mode = self.runner.execute_ahead(batch, meta, self)
        rows = self.results[:n]
        host, copied = rows, None
        if self.device.type == "cuda":
            host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
            host.copy_(rows, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
        else:
            host = rows.clone()
        step = SpecAheadStep(list(reqs), starts, list(ks), pendings, host, copied, chained=prev is not None)
        return step, mode

    # -- landing ----------------------------------------------------------------------------------
    def land(self, step: SpecAheadStep, succ: SpecAheadStep | None
             ) -> tuple[SchedulerOutput, list[tuple[ScheduledRequest, VerifyResult]], dict[str, float | None]]:
        """The step's results on the host: its batch as it ran (exact starts, the drafts), each
        request's tokens, and what auto expected of each draft. Advances the requests still
        running, trims their blocks to what they keep plus what `succ` (the step launched after
        it, in flight) may still write, and moves `succ`'s starts by what this step accepted."""
        if step.copied is not None:
            step.copied.synchronize()
        rows = step.host.tolist()
        sched, results, expected = SchedulerOutput(), [], {}
        for i, req in enumerate(step.requests):
            k, n, start = step.ks[i], rows[i][0], step.starts[i]
            s = ScheduledRequest(req, start, 1 + k, True, tuple(rows[i][self._drafts_at : self._drafts_at + k]))
            sched.scheduled.append(s)
            results.append((s, VerifyResult(rows[i][self._tokens_at : self._tokens_at + n + 1], n)))
            j = succ.index.get(req.request_id) if succ is not None else None
            if j is not None:
                succ.starts[j] += n
            if req.status != RequestStatus.RUNNING:
                continue  # stopped by the step before, or aborted: its row was wasted
            assert req.num_computed_tokens == start, "steps ahead land in order"
            req.num_computed_tokens = start + 1 + n
            reserve = 1 + succ.ks[j] if j is not None else 0  # the query of the step in flight
            self.kv.trim(req, req.num_computed_tokens + reserve)
            expected[req.request_id] = self.spec.observe_ahead(req, start, k, n, step.pendings[i])
        return sched, results, expected
