"""Continuous batching: which requests run this step and how many tokens each.

One token budget per step (`max_num_batched_tokens`) is shared by decodes and prefill chunks.
Running requests go first (so decodes keep flowing while a long prompt is prefilled in chunks),
then waiting ones in arrival order. When blocks run out the newest running request is preempted:
its blocks are freed and it is recomputed later from its prompt and the tokens it already has.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from tandem.config import SchedulerConfig
from tandem.core import Request, RequestStatus
from tandem.kv.manager import KVCacheManager

logger = logging.getLogger("tandem")


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step, fixed when scheduled (the request itself moves on).

    A verifying request (speculative decoding) runs its last token plus `draft`: its query is
    1 + len(draft) tokens, the draft tokens are not in the request's token list (they live here,
    for this step only), and it needs 1 + len(draft) logits rows.

    A decode scheduled ahead (async scheduling, `Scheduler.schedule_ahead`) runs a token the
    previous step sampled that is not in the request's token list yet: `input_row` is its row in
    that step's sampled tokens, which the runner reads on the device."""

    request: Request
    start: int  # first query position (the request's computed tokens when scheduled)
    num_tokens: int  # query tokens this step, draft tokens included
    samples: bool  # the step reaches the request's last known token: its logits are sampled
    draft: tuple[int, ...] = ()  # proposed tokens after the request's last one, to verify
    input_row: int | None = None  # the query's token: this row of the previous step's sampled tokens

    @classmethod
    def of(cls, request: Request, num_tokens: int, draft: tuple[int, ...] = ()) -> ScheduledRequest:
        start = request.num_computed_tokens
        return cls(request, start, num_tokens + len(draft), start + num_tokens == request.num_tokens, draft)

    @property
    def num_logits(self) -> int:
        """Logits rows the step needs for this request: 1 + len(draft) when it samples, else 0."""
        return 1 + len(self.draft) if self.samples else 0


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Requests that can never fit in the KV cache, already finished here with reason "error".
    rejected: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def has_prompt_work(self) -> bool:
        """Whether a request computes more than one token and its drafts, or samples nothing: a
        prompt chunk (or a recomputation after preemption). Every engine pays for such a step,
        so a step cost learned from one says nothing about a K (`SpecDecoder.observe_step`)."""
        return any(s.num_tokens != 1 + len(s.draft) or not s.samples for s in self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        # Bumped whenever `running` gains or loses a request: equal values mean the same batch
        # (the speculative stage repeats a held choice on that alone, `SpecDecoder.repeat_zero`).
        self.running_changes = 0

    # -- queue management -------------------------------------------------------------------
    def add(self, req: Request) -> None:
        """Queue a request. Raises ValueError when its prompt can never fit in the KV cache."""
        if not self.kv.can_fit(req.num_tokens + 1):
            raise ValueError(
                f"the prompt needs {self.kv.blocks_needed(req.num_tokens + 1)} KV blocks but the cache "
                f"has {self.kv.num_blocks}; shorten the prompt or raise --kv-cache-memory"
            )
        req.status = RequestStatus.WAITING
        self.waiting.append(req)
        self.requests[req.request_id] = req

    def finish(self, req: Request, reason: str) -> None:
        """Remove a request (finished or aborted) and free its blocks. Idempotent."""
        if req.status == RequestStatus.FINISHED:
            return
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
            self.running_changes += 1
        elif req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = req.finish_reason or reason
        self.kv.free(req)
        self.requests.pop(req.request_id, None)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step -----------------------------------------------------------------------------
    def schedule(self, drafts: Mapping[str, Sequence[int]] | None = None) -> SchedulerOutput:
        """This step's batch. `drafts` holds proposed tokens of running requests past their
        prefill (request id -> draft); each is scheduled after its request's last token, cut to
        the token budget, and dropped when its slots do not fit (a draft never preempts)."""
        out = self._schedule(drafts or {}, None, 0)
        assert out is not None  # only a step ahead gives up
        return out

    def schedule_ahead(self, prev: SchedulerOutput, max_model_len: int) -> SchedulerOutput | None:
        """The step after `prev`, planned while `prev` is in flight (async scheduling): `prev` is
        already advanced, and the tokens it sampled are still on the device. Each request that
        sampled in `prev` decodes its pending token (`input_row`: its row among `prev`'s sampling
        requests), except one whose pending token is known to be its last (max_tokens, the context
        length); prefill chunks and admissions are planned as `schedule` plans them. A stop the
        pending token itself causes (EOS, a stop string) is found only afterwards: that request's
        row in this step is wasted and dropped.

        None when the step must be planned by `schedule` instead, once `prev` has landed: a slot
        does not fit (`schedule` preempts), a request with a grammar runs or waits first (its mask
        follows each token), nothing runs. What it did by then stays valid for `schedule`: slots
        allocated for a request's next tokens, a request admitted with its prefix hit."""
        if not self.running or any(r.params.grammar is not None for r in self.running):
            return None
        sampled = [s.request for s in prev.scheduled if s.samples]
        pending = {id(req): row for row, req in enumerate(sampled) if req.status == RequestStatus.RUNNING}
        return self._schedule({}, pending, max_model_len)

    def _schedule(self, drafts: Mapping[str, Sequence[int]], pending: dict[int, int] | None,
                  max_model_len: int) -> SchedulerOutput | None:
        """`schedule` (pending None) or `schedule_ahead` (pending: id(request) -> its row among the
        step in flight's sampled tokens)."""
        out = SchedulerOutput()
        budget = self.config.batched_tokens
        scheduled_ids: set[str] = set()
        ahead = pending is not None

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            row = pending.get(id(req)) if ahead else None
            if row is not None:
                i += 1
                if req.num_output_tokens + 1 >= req.max_tokens or req.num_tokens + 1 >= max_model_len:
                    continue  # the pending token ends it
                if not self.kv.allocate_slots(req, 1):
                    return None
                out.scheduled.append(ScheduledRequest(req, req.num_computed_tokens, 1, True, input_row=row))
                budget -= 1
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if n <= 0:  # cannot happen for a running request; guard against a stuck loop
                i += 1
                continue
            draft = tuple(drafts.get(req.request_id, ()))[: budget - n] if n == 1 else ()
            if draft and not self.kv.allocate_slots(req, n + len(draft)):
                draft = ()
            if ahead:
                if not self.kv.allocate_slots(req, n):
                    return None  # never preempt ahead
            elif not draft and not self._allocate_or_preempt(req, n, out, scheduled_ids):
                break  # req itself was preempted (it was the newest); nothing after it runs
            out.scheduled.append(ScheduledRequest.of(req, n, draft))
            scheduled_ids.add(req.request_id)
            budget -= n + len(draft)
            i += 1

        # New work only when nothing was preempted this step: otherwise it would take the blocks back.
        while not out.preempted and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if ahead and req.params.grammar is not None:
                return None
            hit = self.kv.find_prefix(req)
            remaining = req.num_tokens - hit.num_tokens
            n = min(remaining, budget)
            if n < remaining and not self.config.enable_chunked_prefill:
                break
            if not self.kv.allocate_slots(req, n, hit):
                if not self.running:
                    # An empty cache cannot hold it: it would wait forever. Reject instead.
                    self._reject(req, out)
                    continue
                break
            self.waiting.popleft()
            if req.num_preemptions == 0:
                req.num_cached_prompt_tokens = hit.num_tokens
            req.num_computed_tokens = hit.num_tokens
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self.running_changes += 1
            out.scheduled.append(ScheduledRequest.of(req, n))
            budget -= n
        if ahead and not out.scheduled:
            return None
        return out

    def _allocate_or_preempt(
        self, req: Request, n: int, out: SchedulerOutput, scheduled_ids: set[str]
    ) -> bool:
        """Allocate slots for a running request, preempting the newest running requests until it
        fits. False if `req` itself had to be preempted."""
        while not self.kv.allocate_slots(req, n):
            victim = self.running[-1]
            if victim.request_id in scheduled_ids:  # never preempt work already in this step
                return False
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is req:
                if not self.running and not self.kv.can_fit(req.num_tokens + 1):
                    # Alone it cannot grow further: the cache is smaller than this sequence.
                    self._reject(req, out)
                return False
        return True

    def _reject(self, req: Request, out: SchedulerOutput) -> None:
        self.finish(req, "error")
        out.rejected.append(req)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.running_changes += 1
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        logger.debug("preempted %s (%d tokens); it will be recomputed", req.request_id, req.num_tokens)

    def update_after_step(self, out: SchedulerOutput, accepted: Mapping[str, int] | None = None) -> None:
        """Once the step's forward pass ran: `advance`, then `commit` (an async step does both at launch)."""
        self.advance(out, accepted)
        self.commit(out)

    def advance(self, out: SchedulerOutput, accepted: Mapping[str, int] | None = None) -> None:
        """Advance computed-token counts by what the step keeps (an async step: once launched).

        `accepted` gives, per verifying request, how many of its draft tokens were accepted: their
        K/V stay; the slots of the rejected ones are given back (the block table is trimmed to the
        tokens kept). Requests that finished meanwhile are skipped (their blocks are free)."""
        accepted = accepted or {}
        for s in out.scheduled:
            req = s.request
            if req.status != RequestStatus.RUNNING:
                continue
            kept = s.num_tokens - len(s.draft) + min(accepted.get(req.request_id, 0), len(s.draft))
            req.num_computed_tokens += kept
            if s.draft:
                self.kv.trim(req, req.num_computed_tokens)

    def commit(self, out: SchedulerOutput) -> None:
        """Let the KV manager register the step's requests' blocks that are complete: computed and
        every token of them in the request's list (`KVCacheManager.commit`)."""
        for s in out.scheduled:
            if s.request.status == RequestStatus.RUNNING:
                self.kv.commit(s.request)
