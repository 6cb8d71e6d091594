"""The engine's speculative-decoding stage: per request, the draft depth K (the policy) and the
draft (the proposer), and the phase each request is in.

`SpecDecoder.propose(requests)` is called once per step, before scheduling, for the running
requests whose prompt is computed; it returns the drafts the scheduler is to verify. The K policy
is `choose_k`: `adaptive: off` gives every request Kmax, `phase` gives `phase_k[phase]` from the
request's `PhaseTracker`. Either way K is cut to what the request may still generate, so no draft
reaches past max_tokens or the context. (The goodput controller of the next issue replaces
`choose_k`; the proposer and the engine stay as they are.)

Phase trackers are fed the tokens a request kept, lazily: each call catches a tracker up with the
request's output tokens since the last call. Draft tokens are never part of a request's tokens
(they live in the step's `ScheduledRequest`), so rejected drafts never reach a tracker or an
n-gram index.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from tandem.config import SpecConfig
from tandem.core import Request
from tandem.spec.ngram import NgramProposer
from tandem.spec.phase import CONTENT, Phase, PhaseMarkers, PhaseTracker
from tandem.tokenizer import Tokenizer

logger = logging.getLogger("tandem")

K_LOG_INTERVAL_S = 1.0  # rate limit of the INFO line on a request's K change


class _Tracked:
    """A request's phase tracker and how many of its output tokens it has seen."""

    def __init__(self, tracker: PhaseTracker) -> None:
        self.tracker = tracker
        self.seen = 0
        self.k: int | None = None  # the K chosen last, for the log line when it changes


class SpecDecoder:
    def __init__(self, config: SpecConfig, tokenizer: Tokenizer, max_model_len: int) -> None:
        if config.method != "ngram":
            raise ValueError(f"speculative method {config.method!r} is not wired into the engine")
        self.config = config
        self.max_model_len = max_model_len
        self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.markers = PhaseMarkers.from_tokenizer(tokenizer)
        self._tracked: dict[str, _Tracked] = {}
        self._last_k_log = -K_LOG_INTERVAL_S  # monotonic time of the last INFO line on a K change
        self._unlogged_k_changes = 0

    def phase(self, req: Request) -> Phase:
        """The request's phase after the tokens it kept up to the last `propose`."""
        tracked = self._tracked.get(req.request_id)
        return tracked.tracker.phase if tracked else CONTENT

    def choose_k(self, req: Request) -> int:
        """The draft depth for the request's next step: the policy's K, cut so that the draft and
        the token after it stay within max_tokens and the context length."""
        k = self.config.k_for(self._track(req).tracker.phase)
        room = min(req.max_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens) - 1
        return max(0, min(k, room))

    def propose(self, requests: Sequence[Request]) -> dict[str, list[int]]:
        """Drafts for requests past their prefill (request id -> 1..K tokens); a request with K = 0
        or no n-gram match gets none and decodes one token as without speculation."""
        reqs = [r for r in requests if r.num_computed_tokens == r.num_tokens - 1]
        ks = [self.choose_k(r) for r in reqs]
        for req, k in zip(reqs, ks):
            tracked = self._tracked[req.request_id]
            if k != tracked.k and tracked.k is not None:
                self._log_k_change(req.request_id, tracked.k, k, tracked.tracker.phase)
            tracked.k = k
        drafts = self.proposer.propose(reqs, ks)
        return {r.request_id: d for r, d in zip(reqs, drafts) if d}

    def _log_k_change(self, request_id: str, old: int, new: int, phase: Phase) -> None:
        """An INFO line when a request's K changes, at most one per K_LOG_INTERVAL_S (the next line
        says how many changes went unlogged meanwhile); every change at DEBUG."""
        now = time.monotonic()
        if now - self._last_k_log < K_LOG_INTERVAL_S:
            self._unlogged_k_changes += 1
            logger.debug("request %s: K %d -> %d (phase=%s)", request_id, old, new, phase)
            return
        more = f" (+{self._unlogged_k_changes} more K changes since the last line)" if self._unlogged_k_changes else ""
        logger.info("request %s: K %d -> %d (phase=%s)%s", request_id, old, new, phase, more)
        self._last_k_log, self._unlogged_k_changes = now, 0

    def remove(self, request_id: str) -> None:
        """Forget a finished or aborted request."""
        self._tracked.pop(request_id, None)
        self.proposer.remove(request_id)

    def _track(self, req: Request) -> _Tracked:
        tracked = self._tracked.get(req.request_id)
        if tracked is None:
            tracked = self._tracked[req.request_id] = _Tracked(PhaseTracker(self.markers, req.prompt_token_ids))
        out = req.output_token_ids
        if tracked.seen < len(out):
            tracked.tracker.update(out[tracked.seen :])
            tracked.seen = len(out)
        return tracked
