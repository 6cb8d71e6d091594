"""Shared state types: sampling parameters, a request's sequence state, and step outputs.

The scheduler owns `Request.status` and `num_computed_tokens`; the KV manager owns block tables
(kept in `kv/manager.py`, keyed by request id); the engine appends output tokens.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

MAX_LOGPROBS = 20


class ParamError(ValueError):
    """An invalid request parameter; `param` names it (served as HTTP 400)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request. temperature 0 means greedy."""

    max_tokens: int | None = 16  # None: up to the context length
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # number of top logprobs per generated token (0: only the chosen)
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ParamError(f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens")
        if self.temperature < 0:
            raise ParamError(f"temperature must be non-negative, got {self.temperature}", "temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise ParamError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k < -1:
            raise ParamError(f"top_k must be -1 (off), 0 (off) or positive, got {self.top_k}", "top_k")
        if not 0.0 <= self.min_p <= 1.0:
            raise ParamError(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ParamError("presence_penalty must be in [-2, 2]", "presence_penalty")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ParamError("frequency_penalty must be in [-2, 2]", "frequency_penalty")
        if self.repetition_penalty <= 0:
            raise ParamError("repetition_penalty must be positive", "repetition_penalty")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ParamError(f"logprobs must be between 0 and {MAX_LOGPROBS}", "logprobs")
        if self.min_tokens < 0:
            raise ParamError("min_tokens must be non-negative", "min_tokens")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass
class Request:
    """One sequence being generated. Derived values are properties, never stored copies."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    max_tokens: int = 16  # resolved from params and the context length
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_prompt_tokens: int = 0  # prefix-cache hits at first scheduling
    num_preemptions: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def is_prefill(self) -> bool:
        """True while the tokens known so far are not all in the cache yet (beyond the last one)."""
        return self.num_computed_tokens < self.num_tokens - 1


@dataclass(frozen=True)
class Logprob:
    token_id: int
    logprob: float


@dataclass(frozen=True)
class TokenLogprobs:
    """Logprob of the chosen token and the top-N alternatives at one position."""

    chosen: Logprob
    top: tuple[Logprob, ...]


@dataclass
class RequestOutput:
    """What one engine step produced for one request (a delta: new tokens and text only)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    logprobs: list[TokenLogprobs] | None = None
    error: str | None = None
