"""Async scheduling: a decode step launched before the previous one's tokens are on the host.

In steady decoding the host's share of a step (appending tokens, stop checks, detokenizing,
scheduling, staging the graph's inputs) otherwise runs while the device idles. With async
scheduling the engine launches step N+1 first, its input tokens read on the device from step N's
sampled tokens (`ScheduledRequest.input_row`), and only then waits for step N's tokens and
post-processes them, so that work overlaps step N+1's forward pass. The output is the same: a
request that step N's token stops (EOS, a stop string) has one wasted row in step N+1, dropped;
stops known in advance (max_tokens, the context length) are not scheduled ahead at all.

Only steps whose every request is a plain one-token decode go ahead (`can_go_ahead`); anything
that needs the host between steps (speculation, grammars, logprobs, a request to admit, a
preemption) runs the synchronous step. Penalties and min_tokens go ahead: the sampler counts the
pending token on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.core import Request
from tandem.engine.scheduler import SchedulerOutput


@dataclass
class InFlightStep:
    """A launched step: its forward pass and sampling are queued on the device, its tokens on
    their way to host memory."""

    sched: SchedulerOutput
    tokens: torch.Tensor  # [S] int64 on the device: each scheduled request's sampled token
    host: torch.Tensor  # [S] int64, their host copy (pinned on CUDA), complete once `copied` is
    copied: torch.cuda.Event | None  # None on the CPU: the copy is done when it returns

    @classmethod
    def launch(cls, sched: SchedulerOutput, tokens: torch.Tensor) -> InFlightStep:
        """Queue the copy of `tokens` to the host behind the step's work."""
        if tokens.device.type != "cuda":
            return cls(sched, tokens, tokens, None)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return cls(sched, tokens, host, copied)

    def token_ids(self) -> list[int]:
        """The sampled tokens, waiting for the device if it is not done yet."""
        if self.copied is not None:
            self.copied.synchronize()
        return self.host.tolist()


def plain_decode(req: Request) -> bool:
    """Whether a request's next token needs nothing from the host but its sampling parameters and
    token lists: no grammar (its mask follows each token) and no logprobs (returned with each
    token). Penalties and min_tokens count the pending token on the device (`Sampler.sample`)."""
    p = req.params
    return p.grammar is None and p.logprobs is None


def can_go_ahead(sched: SchedulerOutput, num_running: int) -> bool:
    """Whether the step after `sched` may be scheduled before `sched`'s tokens are known: every
    running request decodes one token in it, with no draft, and samples it plainly."""
    return (len(sched.scheduled) == num_running and not sched.preempted
            and all(s.num_tokens == 1 and s.samples and not s.draft and plain_decode(s.request)
                    for s in sched.scheduled))
