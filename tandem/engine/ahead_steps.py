"""The engine's steps that go ahead (async scheduling, tandem/engine/inflight.py and
tandem/engine/spec_ahead.py): launching a step before the one in flight has landed, and landing
it. A mixin of `LLMEngine`, whose state it shares (the step in flight, the scheduler, the runner,
the speculative stage); split from engine.py by responsibility, not reused elsewhere."""

from __future__ import annotations

import time

from tandem.core import RequestOutput, RequestStatus
from tandem.engine.errors import raise_if_fatal
from tandem.engine.inflight import InFlightStep
from tandem.engine.runner import ForwardOutput
from tandem.engine.scheduler import SchedulerOutput
from tandem.engine.spec_ahead import SpecAheadStep


class AheadSteps:
    """`LLMEngine`'s steps ahead: plain ones (`_launch`, `_land`) and speculative ones
    (`_spec_step_ahead`, `_land_spec`), and the call that launches the next before landing the
    one in flight (`_step_ahead`)."""

    def _launch(self, sched: SchedulerOutput, forward: ForwardOutput, prev: InFlightStep | None = None) -> bool:
        """Sample the step on the device and leave it in flight: its tokens land in the next call
        (`prev`: the step in flight it was scheduled ahead of, whose tokens it counts as pending).
        False when sampling raised (the caller samples the step synchronously, row by row)."""
        sampling = [s for s in sched.scheduled if s.samples]  # forward.logits: one row each
        pending = None if prev is None else [None if s.input_row is None else prev.tokens[s.input_row]
                                             for s in sampling]
        reqs = [s.request for s in sampling]
        try:
            tokens = self.sampler.sample(forward.logits, reqs, pending)
            logprobs = self.sampler.logprobs_on_device(forward.logits, reqs, tokens)
        except Exception as e:  # noqa: BLE001 - `sample_step` retries and blames the rows
            raise_if_fatal("sampling", e)
            self.sampler.rollback()
            return False
        self.scheduler.advance(sched)
        # Registered now, not when the tokens land: the next step's slots (planned before then)
        # may give back a sliding window's blocks, which must carry their hashes when they go. A
        # later step that hits them runs after this one on the device.
        self.scheduler.commit(sched)
        prefilled = self.spec is not None and self.spec.take_drafter_prefilled()  # by `_observe`, just before
        self._in_flight = InFlightStep.launch(sched, tokens, logprobs, chained=prev is not None,
                                              drafter_prefilled=prefilled, asleep=self.waits_asleep)
        self.num_async_steps += 1
        return True

    def _step_ahead(self) -> list[RequestOutput]:
        """With a step in flight: launch the step after it when that can be planned now
        (`Scheduler.schedule_ahead`), then land the one in flight. `_in_flight` is left None when
        nothing went ahead; the caller then runs a synchronous step."""
        prev, self._in_flight = self._in_flight, None
        started = time.perf_counter()
        if isinstance(prev, SpecAheadStep):
            self._spec_step_ahead(prev)
            return self._land_spec(prev) + self._ahead_failed()
        if not (self.async_scheduling and self._plain_ahead(prev)):
            self._spec_step_ahead(prev)
            return self._land(prev) + self._ahead_failed()
        nxt = self.scheduler.schedule_ahead(prev.sched, self.max_model_len)
        if nxt is None:
            return self._land(prev)
        if self.spec is not None:
            self._count_spec_step()  # the K = 0 plan_ahead chose
        try:
            forward = self.runner.execute(nxt.scheduled, pending=prev.tokens)
        except Exception as e:  # noqa: BLE001 - as in `step`
            outputs = self._land(prev)
            alive = [s.request for s in nxt.scheduled if s.request.status == RequestStatus.RUNNING]
            return outputs + self._fail_step("running the model", e, alive)
        self._ran(forward.mode)
        failed = self._observe(nxt, {}, forward)
        if failed is not None:
            return self._land(prev) + failed
        launched = self._launch(nxt, forward, prev)
        # `prev`'s time runs from the last landing to its own and so holds `nxt`'s launch: with a
        # prompt chunk in it (the target's prefill staged, a draft model fed it) that time is no
        # plain step's cost. Learned as one, it charged prompt work to K = 0 (with a new request
        # every few steps at 16, often).
        outputs = self._land(prev, timed=not nxt.has_prompt_work)
        if not launched:  # after `prev`'s tokens: a request they stopped is skipped
            outputs += self._finish_step(nxt, forward, {}, started, observed=True)
        return outputs

    def _spec_step_ahead(self, prev: InFlightStep | SpecAheadStep | None) -> bool:
        """Launch a speculative step ahead of `prev` (tandem/engine/spec_ahead.py; None: nothing in
        flight) when one can go, leaving it in `_in_flight`. False when none went: the step in
        flight lands, and the synchronous step runs next."""
        ahead = self._spec_ahead
        if ahead is None or not self.async_scheduling:
            return False
        assert self.spec is not None
        reqs = ahead.eligible(prev)
        if reqs is None:
            return False
        held = False
        ks = self.spec.take_planned(reqs)  # plan_ahead's choice for the step after a plain one, if it drafts
        if ks is None:
            ks = self.spec.choose_ahead(reqs, ahead.in_flight_drafts(reqs, prev))
            held = ks is None
            if held:  # auto repeats its last choice (all zero, or a padded batch's)
                ks = self.spec.held_ks(reqs)
        if not any(ks) and not isinstance(prev, SpecAheadStep):
            return False  # a plain step: the plain path runs it (after a step ahead, this one must)
        pendings = self.spec.pending_choices(reqs)
        try:
            launched = ahead.launch(reqs, ks, prev, pendings, asleep=self.waits_asleep)
        except Exception as e:  # noqa: BLE001 - as a failed forward in `step`: its requests end
            self._ahead_failure = (e, reqs)  # after the step in flight lands (`_ahead_failed`)
            return False
        if launched is None:
            return False
        if not held:
            self.spec.commit_ahead(reqs, ks)
        self._count_spec_step()
        step, mode = launched
        self._ran(mode)
        self._in_flight = step
        self.num_async_steps += 1
        return True

    def _ahead_failed(self) -> list[RequestOutput]:
        """The requests of a speculative step ahead whose launch raised end with an error (as a
        step whose forward failed: `_fail_step`), once the step before it has landed."""
        failure, self._ahead_failure = self._ahead_failure, None
        if failure is None:
            return []
        error, reqs = failure
        return self._fail_step("running a speculative step ahead", error,
                               [r for r in reqs if r.status == RequestStatus.RUNNING])

    def _land_spec(self, step: SpecAheadStep) -> list[RequestOutput]:
        """A speculative step ahead's tokens (`SpecAhead.land`), appended and checked as a
        synchronous verify's are; its complete blocks registered; timed when it went ahead of
        another step."""
        assert self._spec_ahead is not None
        succ = self._in_flight if isinstance(self._in_flight, SpecAheadStep) else None
        sched, results, expected = self._spec_ahead.land(step, succ)
        outputs = self._postprocess(sched, list(results), expected)
        self.scheduler.commit(sched)
        self._time_step(sched, self._results_at if step.chained else None, drafted=step.ks)
        return outputs

    def _plain_ahead(self, prev: InFlightStep) -> bool:
        """With speculation: whether the K policy drafts nothing for the requests decoding after
        `prev` (`SpecDecoder.plan_ahead`), so the step after it can go ahead. Without: True."""
        if self.spec is None:
            return True
        changes = self.scheduler.running_changes
        if self.spec.repeat_zero(changes):  # the same batch, still held at K = 0
            return True
        decoding = [s.request for s in prev.sched.scheduled if s.samples and s.request.status == RequestStatus.RUNNING]
        return self.spec.plan_ahead(decoding, changes if len(decoding) == len(self.scheduler.running) else None)

    def _land(self, step: InFlightStep, timed: bool = True) -> list[RequestOutput]:
        """The in-flight step's tokens: appended and checked (`_postprocess`; a request stopped or
        aborted meanwhile is skipped), then the blocks they complete are registered (written by
        the step launched after, if any; the step's own were registered at launch). `timed`
        False: its time is not a step cost to learn from (the caller says why)."""
        outputs = self._postprocess(step.sched, step.results())
        self.scheduler.commit(step.sched)
        # Timed only when it went ahead of another step: in a run of steps ahead each adds what
        # one step costs with its host work overlapped. The first of a run also carries the
        # call that launched it, which overlapped nothing (and one landing after the engine ran
        # dry, the time it sat idle).
        since = self._results_at if step.chained and timed else None
        self._time_step(step.sched, since, prefilled=step.drafter_prefilled)
        return outputs
