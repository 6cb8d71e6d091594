"""The interface every proposer of speculative drafts implements (n-gram lookup, a draft model,
DSpark), so the engine and the K policy never know which one runs.

A step with speculation is: `propose` (drafts for the requests the policy gave K > 0) -> the
target verifies them in one forward -> `observe` (what the step kept, so a proposer with state of
its own — a draft model's KV cache, DSpark's window of target hidden states — stays in step with
the target) -> `remove` when a request ends or is preempted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from tandem.core import Request
from tandem.engine.scheduler import ScheduledRequest


@dataclass(frozen=True)
class Draft:
    """One request's proposed tokens for one step.

    probs: [len(tokens), V] float32, row i the distribution tokens[i] was drawn from (a sampling
        drafter; the verifier then accepts with min(1, p/q)); None when the tokens were chosen
        deterministically (n-gram lookup, greedy drafting: verified against a one-hot q).
    confidence: [len(tokens)] float32 on the drafter's device: its own estimate of P(token i
        accepted | tokens before it accepted), where it has one (DSpark's confidence head); for the
        K controller (left on the device: reading it is a host sync).
    """

    tokens: list[int]
    probs: torch.Tensor | None = None
    confidence: torch.Tensor | None = None

    def cut(self, k: int) -> Draft:
        """The first k tokens (drafts are prefix-consistent: the first k of a longer draft are the
        k-token draft)."""
        if k >= len(self.tokens):
            return self
        probs = None if self.probs is None else self.probs[:k]
        conf = None if self.confidence is None else self.confidence[:k]
        return Draft(self.tokens[:k], probs, conf)


class Proposer(Protocol):
    def propose(self, requests: Sequence[Request], ks: Sequence[int]) -> list[Draft]:
        """Up to ks[i] tokens for requests[i] (each past its prefill: its last token is known and
        not yet computed); k = 0, or nothing to propose, gives an empty draft."""

    def observe(self, batch: Sequence[ScheduledRequest], kept: Sequence[int], aux: torch.Tensor | None) -> None:
        """After a step's forward pass and verification: batch[i] kept its first kept[i] query
        tokens (a prefill chunk all of them; a verify its last token and the accepted drafts);
        `aux` is the runner's [T, F] aux-layer outputs of every query token, in batch order, when
        the proposer asked for them (`aux_layers`)."""

    def remove(self, request_id: str) -> None:
        """Forget a request (finished, aborted, or preempted: it is recomputed)."""

    def __len__(self) -> int:
        """Requests the proposer holds state for."""
