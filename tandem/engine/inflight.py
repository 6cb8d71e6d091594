"""Async scheduling: a step launched before the previous one's tokens are on the host.

In steady decoding the host's share of a step (appending tokens, stop checks, detokenizing,
scheduling, staging the graph's inputs) otherwise runs while the device idles. With async
scheduling the engine launches step N+1 first, its input tokens read on the device from step N's
sampled tokens (`ScheduledRequest.input_row`), and only then waits for step N's tokens and
post-processes them, so that work overlaps step N+1's forward pass. The output is the same: a
request that step N's token stops (EOS, a stop string) has one wasted row in step N+1, dropped;
stops known in advance (max_tokens, the context length) are not scheduled ahead at all.

A step goes ahead of one whose requests sample plainly (`can_go_ahead`): prefill chunks and new
requests are planned ahead as well (`Scheduler.schedule_ahead`); what needs the host between
steps (a draft to verify, grammars, a preemption) runs the synchronous step. With speculation a
step goes ahead when the K policy drafts nothing for it (`SpecDecoder.plan_ahead`: adaptive auto
at K = 0, a `phase_k` of 0), the proposer catching up on it at launch; DSpark's verify steps
go ahead as well, drafted and accepted on the device (tandem/engine/spec_ahead.py). Penalties and min_tokens
go ahead (the sampler counts the pending token on the device), and so do logprobs (computed on
the device, copied with the tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from tandem.core import Request, TokenLogprobs
from tandem.engine.sampler import host_logprobs
from tandem.engine.scheduler import ScheduledRequest, SchedulerOutput
from tandem.spec.verify import VerifyResult


@dataclass
class InFlightStep:
    """A launched step: its forward pass and sampling are queued on the device, its tokens (and
    the logprobs its requests ask for) on their way to host memory."""

    sched: SchedulerOutput
    tokens: torch.Tensor  # [S] int64 on the device: the sampled token of each request that samples
    host: list[torch.Tensor]  # their host copies (pinned on CUDA): tokens, then the logprobs' three
    copied: torch.cuda.Event | None  # after the copies; None on the CPU (done when they return)
    chained: bool = False  # launched ahead of another step in flight (not the first of a run)
    # The drafter ran prompt work when the step was launched (a draft model fed a prompt chunk):
    # queued before the step's sampling, so the step's landing waits for it too.
    drafter_prefilled: bool = False

    @classmethod
    def launch(cls, sched: SchedulerOutput, tokens: torch.Tensor, logprobs: tuple[torch.Tensor, ...] | None = None,
               chained: bool = False, drafter_prefilled: bool = False, asleep: bool = False) -> InFlightStep:
        """Queue the copies of `tokens` and `logprobs` (`Sampler.logprobs_on_device`) to the host
        behind the step's work. `asleep`: `results` waits for them asleep (a blocking-sync event)
        rather than spinning on a core (`LLMEngine.waits_asleep`)."""
        device = [tokens, *(logprobs or ())]
        if tokens.device.type != "cuda":
            return cls(sched, tokens, device, None, chained, drafter_prefilled)
        host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in device]
        for h, t in zip(host, device):
            h.copy_(t, non_blocking=True)
        copied = torch.cuda.Event(blocking=asleep)
        copied.record()
        return cls(sched, tokens, host, copied, chained, drafter_prefilled)

    @cached_property
    def sampling_rows(self) -> dict[str, int]:
        """request id -> its row of `tokens` (the requests that sample, in batch order)."""
        return {s.request.request_id: i for i, s in enumerate(s for s in self.sched.scheduled if s.samples)}

    def results(self) -> list[tuple[ScheduledRequest, VerifyResult]]:
        """Each request that samples, with its token (and its logprobs when it asks), waiting for
        the device if it is not done yet."""
        if self.copied is not None:
            self.copied.synchronize()
        sampling = [s for s in self.sched.scheduled if s.samples]  # the rows of `tokens`
        tokens = self.host[0].tolist()
        logprobs: list[TokenLogprobs | None] = [None] * len(tokens)
        if len(self.host) > 1:
            logprobs = host_logprobs([s.request for s in sampling], tokens, *(h.tolist() for h in self.host[1:]))
        return [(s, VerifyResult([t], 0, None if lp is None else [lp])) for s, t, lp in zip(sampling, tokens, logprobs)]


def plain_decode(req: Request) -> bool:
    """Whether a request's next token needs nothing from the host but its sampling parameters and
    token lists: no grammar (its mask follows each token). Penalties and min_tokens count the
    pending token on the device (`Sampler.sample`); logprobs travel with the tokens."""
    return req.params.grammar is None


def can_go_ahead(sched: SchedulerOutput) -> bool:
    """Whether the step after `sched` may be planned before `sched`'s tokens are known: no drafts,
    no preemption, every request that samples samples plainly (`plain_decode`)."""
    return not sched.preempted and all(not s.draft and (not s.samples or plain_decode(s.request))
                                       for s in sched.scheduled)
