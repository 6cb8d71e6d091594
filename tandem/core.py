"""Shared state types: sampling parameters, a request's sequence state, and step outputs.

The scheduler owns `Request.status` and `num_computed_tokens`; the KV manager owns block tables
(kept in `kv/manager.py`, keyed by request id); the engine appends output tokens.
"""

from __future__ import annotations

import enum
import math
import numbers
import time
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

MAX_LOGPROBS = 20
MAX_TEMPERATURE = 100.0  # a real model's logits (spread of tens) are nearly flat long before
MAX_COUNT = 2**31 - 1  # token counts, top_k, token ids: what an int32 index holds
# Seeds accepted: what torch.Generator.manual_seed takes, int64 or uint64 ([-2^63, 2^64)).
SEED_MIN, SEED_END = -(2**63), 2**64


class ParamError(ValueError):
    """An invalid request parameter; `param` names it (served as HTTP 400)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def reduce_seed(seed: int) -> int:
    """`seed` modulo 2^64 as a signed 64-bit integer, in [-2^63, 2^63).

    torch reads a negative seed as its two's complement, so the reduced seed gives the same
    generator as the original; and seed + k (the server's per-choice seeds) stays inside
    [-2^63, 2^64) for any k < 2^63, so it wraps around instead of overflowing."""
    return (seed - SEED_MIN) % 2**64 + SEED_MIN


def _shown(value: object) -> str:
    """A value for an error message, cut short (a fuzzer's 400-digit integer stays out of logs)."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _real(name: str, value: object, lo: float, hi: float, *, lo_open: bool = False) -> float:
    """`value` as a float, or ParamError unless it is a finite real number in [lo, hi] ((lo, hi]
    with lo_open). Bools are refused: True is not a temperature."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ParamError(f"{name} must be a number, got {type(value).__name__}", name)
    try:
        x = float(value)
    except OverflowError:  # an int too large for a float is outside every range here
        x = math.inf
    if not ((lo < x if lo_open else lo <= x) and x <= hi):  # NaN fails every comparison
        interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise ParamError(f"{name} must be a finite number in {interval}, got {_shown(value)}", name)
    return x


def _integer(name: str, value: object, lo: int, hi: int, interval: str | None = None) -> int:
    """`value` as an int, or ParamError unless it is an integer in [lo, hi] (`interval` says so in
    the message, when the plain numbers would not read well)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ParamError(f"{name} must be an integer, got {type(value).__name__}", name)
    n = int(value)
    if not lo <= n <= hi:
        raise ParamError(f"{name} must be an integer in {interval or f'[{lo}, {hi}]'}, got {_shown(n)}", name)
    return n


def _flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ParamError(f"{name} must be true or false, got {type(value).__name__}", name)
    return value


def _items(name: str, value: object) -> tuple:
    if not isinstance(value, (list, tuple)):
        raise ParamError(f"{name} must be a list, got {type(value).__name__}", name)
    return tuple(value)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request. temperature 0 means greedy.

    Checked when built (ParamError naming the field; the engine's `validate` adds the checks that
    need the model: stop_token_ids within the vocabulary, the context length). Accepted values:

    - temperature: [0, 100] (below 1e-5: greedy)
    - top_p: (0, 1]; min_p: [0, 1]
    - top_k: -1 or 0 (off), or 1 .. 2^31-1 (at least the vocabulary: off)
    - presence_penalty, frequency_penalty: [-2, 2] (OpenAI's range)
    - repetition_penalty: [0.01, 100] (1: off)
    - max_tokens: None (up to the context length) or 1 .. 2^31-1
    - min_tokens: 0 .. 2^31-1, and at most max_tokens
    - logprobs: None or 0 .. 20
    - seed: None or any integer in [-2^63, 2^64), stored reduced modulo 2^64 (`reduce_seed`)
    - stop: a string or a list of non-empty strings; stop_token_ids: a list of token ids
    - grammar: None, or a Lark grammar in llguidance's dialect the output must follow
      (`tandem/engine/structured.py`; the engine compiles it when the request is added)

    Floats must be finite real numbers (NaN and infinities are refused), integers must be ints
    (not bools, not floats), flags must be bools.
    """

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
    grammar: str | None = None

    def __post_init__(self) -> None:
        # Each field is replaced by its checked, normalised value (plain float / int / tuple).
        set_ = partial(object.__setattr__, self)
        set_("temperature", _real("temperature", self.temperature, 0.0, MAX_TEMPERATURE))
        set_("top_p", _real("top_p", self.top_p, 0.0, 1.0, lo_open=True))
        set_("min_p", _real("min_p", self.min_p, 0.0, 1.0))
        set_("presence_penalty", _real("presence_penalty", self.presence_penalty, -2.0, 2.0))
        set_("frequency_penalty", _real("frequency_penalty", self.frequency_penalty, -2.0, 2.0))
        # The sampler divides positive logits by the penalty and multiplies negative ones by it, in
        # float32. Within [0.01, 100] a logit moves by at most 100x, so no real logit overflows, and
        # the penalty never rounds to 0 (a division by zero) the way 1e-300 does in float32.
        set_("repetition_penalty", _real("repetition_penalty", self.repetition_penalty, 0.01, 100.0))
        set_("top_k", _integer("top_k", self.top_k, -1, MAX_COUNT))  # -1 and 0: off
        if self.max_tokens is not None:
            set_("max_tokens", _integer("max_tokens", self.max_tokens, 1, MAX_COUNT))
        set_("min_tokens", _integer("min_tokens", self.min_tokens, 0, MAX_COUNT))
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ParamError(f"min_tokens ({self.min_tokens}) must be at most max_tokens ({self.max_tokens})",
                             "min_tokens")
        if self.logprobs is not None:
            set_("logprobs", _integer("logprobs", self.logprobs, 0, MAX_LOGPROBS))
        if self.seed is not None:
            set_("seed", reduce_seed(_integer("seed", self.seed, SEED_MIN, SEED_END - 1, "[-2^63, 2^64)")))
        stop = (self.stop,) if isinstance(self.stop, str) else _items("stop", self.stop)
        if not all(isinstance(s, str) and s for s in stop):
            raise ParamError("stop must be a list of non-empty strings", "stop")
        set_("stop", stop)
        ids = _items("stop_token_ids", self.stop_token_ids)
        if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) and 0 <= t <= MAX_COUNT for t in ids):
            raise ParamError("stop_token_ids must be a list of token ids (non-negative integers)", "stop_token_ids")
        set_("stop_token_ids", tuple(int(t) for t in ids))
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            _flag(name, getattr(self, name))
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise ParamError("grammar must be a non-empty string (a Lark grammar)", "grammar")

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


ErrorKind = Literal["invalid", "internal"]


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
    error: str | None = None  # with finish_reason "error": a short message for the client
    # With finish_reason "error", whose fault it was: "invalid", the request can never run here
    # (e.g. it outgrows the whole KV cache: a client error); "internal", the engine failed while
    # running it (a server error; the log has the traceback under the request id).
    error_kind: ErrorKind | None = None


# -- one forward step's token layout ------------------------------------------------------------
# Built by the runner for each forward pass, read by attention, the models and verification; it
# lives here, beside the request, so that models and kernels need not import the engine.

@dataclass(frozen=True)
class GroupState:
    """A compressed cache group's per-request state for one step (host values, in request order;
    tandem/kv/manager.py says what each is): the state slot, the overlap snapshot to copy into the
    slot's ring before the step (-1: none) and the positional snapshot ids this step may write
    (snapshot i holds the overlap at token (i + 1) * `StepMetadata.prefix_unit`)."""

    slots: tuple[int, ...]
    restore: tuple[int, ...]
    snapshots: tuple[tuple[int, ...], ...]
    null_snapshot: int  # the id placeholders read as (row `num_snapshots`: never a real one)


@dataclass(frozen=True)
class StepMetadata:
    """The token layout of one step.

    Tokens of all scheduled requests are packed back to back: request i owns query tokens
    `query_start_loc[i]:query_start_loc[i+1]` (1 for decode, 1+K for speculative verify, a chunk for
    prefill). `seq_lens[i]` counts its tokens in the cache *after* this step's writes.
    """

    request_ids: tuple[str, ...]
    query_start_loc: torch.Tensor  # [B+1] int32, device
    seq_lens: torch.Tensor  # [B] int32, device
    block_tables: tuple[torch.Tensor, ...]  # per cache group: [B, max_blocks] int32, device
    slot_mappings: tuple[torch.Tensor, ...]  # per cache group: [T] int64, device (block*bs + offset)
    logits_indices: torch.Tensor  # [S] int64, device: token rows whose logits are sampled
    # Host copies: the torch reference attention loops over requests with these.
    query_start_loc_cpu: tuple[int, ...]
    seq_lens_cpu: tuple[int, ...]
    block_size: int
    max_query_len: int  # longest query of the step; fixed (1+K) in a captured decode graph
    # Per cache group: its GroupState when the group is compressed, else None (empty: no such group).
    group_states: tuple[GroupState | None, ...] = ()
    prefix_unit: int = 0  # tokens between overlap snapshots (KVCacheManager.unit)
    # The same on the device, for sync-free (capturable) steps; per group, None unless compressed.
    # Pads of a graph point at the sinks (the state slot `num_state_slots`, the null snapshot).
    state_slots: tuple[torch.Tensor | None, ...] = ()  # [T] int64: each token's state slot
    request_state_slots: tuple[torch.Tensor | None, ...] = ()  # [B] int64
    snapshot_slots: tuple[torch.Tensor | None, ...] = ()  # [T] int64: the snapshot a token's window close writes
    restore_ids: tuple[torch.Tensor | None, ...] = ()  # [B] int64: the snapshot to restore first, -1 none

    @property
    def num_requests(self) -> int:
        return len(self.request_ids)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_cpu[-1]


def token_requests(query_start_loc: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """query_start_loc [B + 1] int32 (device) -> each token's request row [num_tokens] int64, on the
    device and of a fixed size (capturable). Padding tokens past the last request get row B - 1."""
    import torch  # (this module imports torch only for type checking)

    tokens = torch.arange(num_tokens, device=query_start_loc.device, dtype=query_start_loc.dtype)
    rows = torch.searchsorted(query_start_loc[1:].contiguous(), tokens, right=True)
    return rows.clamp_(max=query_start_loc.shape[0] - 2)
