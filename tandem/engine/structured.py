"""Structured output: a grammar that a request's output must follow, enforced as a token mask.

A request whose `SamplingParams.grammar` is set (a Lark grammar in llguidance's dialect; a JSON
schema is embedded as `%json {...}` (`json_rule`), a token such as `<tool_call>` is written
`<tool_call>` or by id, `<[4661]>`) gets a matcher that tracks its output. The engine's step
calls this stage at four points:

- after propose, `cut_drafts`: a constrained request's draft is cut to the longest prefix its
  grammar accepts. Verification could never keep a token the mask forbids, so the rest would only
  waste verify slots.
- once the forward pass is launched, `fill`: the masks are built on the CPU from what is known
  before the logits (the tokens and drafts), while the GPU computes them. Row i of a request is
  the set of tokens its grammar allows after its tokens plus draft[:i].
- before sampling and verification, `StepMasks.apply`: the constrained rows of the logits are
  masked in place (forbidden tokens get -inf). Sampler and verifier then see the masked logits,
  so greedy and sampled tokens are always allowed, and rejection sampling stays exact for the
  masked target distribution (p is zero off the mask, so the residual max(0, p - q) is too).
  Logprobs come from these masked logits, as in vLLM.
- for each token the request keeps, `accept`: the matcher consumes it and reports whether the
  grammar is complete; the engine then ends the request with finish_reason "stop" (it does not
  wait for an EOS the grammar would force anyway).

The library is llguidance (also one of vLLM's): it reads tokenizer.json itself, fills a
caller's bitmask buffer, and validates and rolls back draft tokens; its mask cost per token was
measured against xgrammar's (`benchmarks/bench_grammar_libs.py`, BENCHMARKS.md), and xgrammar
would bring transformers and triton into the serving dependencies. It is imported on first use,
so a server that never gets a constrained request does not load it.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import numpy as np
import torch

from tandem.core import ParamError, Request
from tandem.engine.scheduler import ScheduledRequest
from tandem.spec.proposer import Draft
from tandem.tokenizer import Tokenizer

logger = logging.getLogger("tandem.engine")


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError as e:  # a declared dependency: only a broken install gets here
        raise ParamError("structured output needs the llguidance package (pip install llguidance)", "grammar") from e
    return llguidance


# JSON as Python's `json.dumps` writes it (", " and ": " between items, no other whitespace):
# flexible whitespace lets a small model pad its JSON with blank lines until max_tokens.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def json_rule(schema: dict[str, Any]) -> str:
    """A Lark expression for one JSON value valid against `schema`, in `JSON_STYLE` (a schema's own
    "x-guidance" options win), e.g. `SamplingParams(grammar="start: " + json_rule(schema))`."""
    guidance = {**JSON_STYLE, **(schema.get("x-guidance") or {})}
    return "%json " + json.dumps({**schema, "x-guidance": guidance}, ensure_ascii=False)


@functools.cache
def _shifts(device: torch.device) -> torch.Tensor:
    return torch.arange(32, dtype=torch.int32, device=device)


def json_schema_grammar(schema: dict[str, Any], reasoning: tuple[str, str] | None = None) -> str:
    """The grammar of an output that is JSON valid against `schema`. With reasoning = (start tag,
    end tag), both tokens of the vocabulary (e.g. ("<think>", "</think>")), free reasoning comes
    first (the start tag optional: templates may put it in the prompt), then at most a few line
    breaks or spaces, then the JSON; the server writes this for `response_format` (with its own
    rules for tools, `tandem/server/structured.py`)."""
    if reasoning is None:
        return f"start: {json_rule(schema)}"
    start, end = reasoning
    return "\n".join(["start: think gap answer", f"think: {start}? /(?s:.*)/ {end}", r"gap: /[ \t\r\n]{0,8}/",
                      f"answer: {json_rule(schema)}"])


def _unpack(bitmask: torch.Tensor, vocab: int, device: torch.device) -> torch.Tensor:
    """bitmask [M, words] int32 (host) -> forbidden [M, V] bool on `device`. On the CPU numpy
    unpacks it (one call); on a GPU the packed words are copied (V/8 bytes a row, not V) and
    unpacked there."""
    if device.type == "cpu":
        unpacked = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, count=vocab, bitorder="little")
        return torch.from_numpy(unpacked) == 0
    bits = bitmask.to(device, non_blocking=True)
    return ((bits[:, :, None] >> _shifts(device)) & 1).view(bits.shape[0], -1)[:, :vocab] == 0


class MaskCache:
    """Unpacked masks by their packed bits, least recently used dropped past `size`. Most steps of
    a constrained request repeat a mask seen before (free reasoning allows every ordinary token;
    inside a JSON string every character but a few), and a hit skips the copy and the unpacking:
    masking is then one kernel. Holds size * V bytes on the logits' device."""

    def __init__(self, size: int = 64) -> None:
        self.size = size
        self._masks: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.hits = self.misses = 0

    def forbidden(self, bitmask: torch.Tensor, vocab: int, device: torch.device) -> list[torch.Tensor]:
        """The forbidden [V] bool mask of each bitmask row, on `device`."""
        out = []
        packed = bitmask.numpy()
        for n in range(packed.shape[0]):
            key = packed[n].tobytes()
            mask = self._masks.get(key)
            if mask is None:
                self.misses += 1
                mask = self._masks[key] = _unpack(bitmask[n : n + 1], vocab, device)[0]
                if len(self._masks) > self.size:
                    self._masks.popitem(last=False)
            else:
                self.hits += 1
                self._masks.move_to_end(key)
            out.append(mask)
        return out


def apply_token_bitmask(logits: torch.Tensor, rows: Sequence[int], bitmask: torch.Tensor,
                        cache: MaskCache | None = None) -> None:
    """In place: logits [R, V]; rows: the M row indices to mask; bitmask [M, ceil(V/32)] int32 on the
    CPU, bit j of word w allowing token 32 * w + j. Disallowed tokens of those rows become -inf.
    With a cache, masks seen before are not unpacked again."""
    if not rows:
        return
    vocab, dev = logits.shape[1], logits.device
    if cache is None:
        forbidden = _unpack(bitmask, vocab, dev)  # [M, V]
    else:
        masks = cache.forbidden(bitmask, vocab, dev)
        forbidden = masks[0][None] if len(masks) == 1 else torch.stack(masks)
    with torch.inference_mode():  # the runner's logits are inference tensors
        if len(rows) == 1:
            logits[rows[0]].masked_fill_(forbidden[0], float("-inf"))
        else:
            index = torch.tensor(rows, dtype=torch.long, device=dev)
            logits[index] = logits[index].masked_fill(forbidden, float("-inf"))


@dataclass(frozen=True)
class StepMasks:
    """One step's grammar masks: bitmask row n masks logits row rows[n]. `failed`: the requests
    (by id) whose mask could not be built, e.g. a draft token the grammar refuses (drafts are cut
    first, so only a bug gets there); their rows are not masked and must not be sampled."""

    rows: list[int]
    bitmask: torch.Tensor  # [len(rows), words] int32, host
    failed: dict[str, Exception]
    cache: MaskCache | None = None

    def apply(self, logits: torch.Tensor) -> None:
        """Mask the step's logits [R, V] in place."""
        apply_token_bitmask(logits, self.rows, self.bitmask, self.cache)


class StructuredOutputs:
    """The per-request grammar matchers of an engine (the one owner of that state)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the logits' width: the model's vocabulary, padding included
        self.words = (vocab_size + 31) // 32
        self._lltok: Any = None
        self._lock = threading.Lock()  # `check` runs on server threads, the rest on the engine's
        self._matchers: dict[str, Any] = {}
        self._host: torch.Tensor | None = None  # bitmask rows, reused across steps (`_buffer`)
        self.mask_cache = MaskCache()

    def _tokenizer(self) -> Any:
        """llguidance's view of the vocabulary, built on first use (about 1 s for a 150k vocabulary)."""
        with self._lock:
            if self._lltok is None:
                llg = _llguidance()
                start = time.perf_counter()
                self._lltok = llg.LLTokenizer(
                    self.tokenizer.fast.to_str(), n_vocab=self.vocab_size, eos_token=sorted(self.tokenizer.eos_token_ids)
                )
                logger.info("Structured output: grammar tokenizer built in %.2f s", time.perf_counter() - start)
            return self._lltok

    def check(self, grammar: str) -> str | None:
        """None when `grammar` compiles against this vocabulary, else llguidance's message. Any thread."""
        if not isinstance(grammar, str) or not grammar.strip():
            return "the grammar must be a non-empty string"
        llg = _llguidance()
        error = llg.LLMatcher.validate_grammar(llg.LLMatcher.grammar_from_lark(grammar), self._tokenizer())
        return error or None

    # -- the engine's calls --------------------------------------------------------------------
    def add(self, req: Request) -> None:
        """Compile the grammar of a new request; ParamError("grammar") when it does not compile."""
        grammar = req.params.grammar
        assert grammar is not None
        llg = _llguidance()
        matcher = llg.LLMatcher(self._tokenizer(), llg.LLMatcher.grammar_from_lark(grammar), log_level=0)
        if matcher.is_error():
            raise ParamError(f"invalid grammar: {matcher.get_error()}", "grammar")
        self._matchers[req.request_id] = matcher

    def remove(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def __len__(self) -> int:
        return len(self._matchers)

    def cut_drafts(self, drafts: Mapping[str, Draft]) -> dict[str, Draft]:
        """Each constrained request's draft cut to the prefix its grammar accepts."""
        out = dict(drafts)
        for rid, draft in drafts.items():
            matcher = self._matchers.get(rid)
            if matcher is not None and draft.tokens:
                valid = matcher.validate_tokens(list(draft.tokens))
                if valid < len(draft.tokens):
                    out[rid] = draft.cut(valid)
        return out

    def fill(self, batch: Sequence[ScheduledRequest]) -> StepMasks | None:
        """The masks of this step's constrained requests, built on the CPU from what is known before
        the logits (their tokens and drafts), so the engine runs this while the GPU computes them.
        Rows are numbered as the runner's logits: each sampling request's `num_logits` rows in batch
        order. None when no request of the step is constrained."""
        sampling = [s for s in batch if s.samples]
        work = [(j, s, self._matchers[s.request.request_id]) for j, s in enumerate(sampling)
                if s.request.request_id in self._matchers]
        if not work:
            return None
        offsets = list(accumulate((s.num_logits for s in sampling), initial=0))
        bitmask = self._buffer(sum(s.num_logits for _, s, _ in work))
        rows: list[int] = []  # rows[n]: the logits row that bitmask row n masks
        failed: dict[str, Exception] = {}
        for j, s, matcher in work:
            try:
                rows += self._fill(matcher, list(s.draft), bitmask, len(rows), offsets[j])
            except Exception as e:  # noqa: BLE001 - this request alone
                failed[s.request.request_id] = e
        return StepMasks(rows, bitmask[: len(rows)], failed, self.mask_cache)

    def _buffer(self, num_rows: int) -> torch.Tensor:
        """A [num_rows, words] int32 view of a reused host buffer, pinned when a GPU reads it (the
        copy is then asynchronous). Reuse is safe: a step's copy is done before the next step fills
        (the sampler's host sync of the tokens comes in between)."""
        if self._host is None or self._host.shape[0] < num_rows:
            pin = torch.cuda.is_available()
            self._host = torch.empty((max(num_rows, 64), self.words), dtype=torch.int32, pin_memory=pin)
        return self._host[:num_rows]

    def _fill(self, matcher: Any, draft: list[int], bitmask: torch.Tensor, start: int, offset: int) -> list[int]:
        """Fill bitmask rows start .. start + len(draft): the mask after each draft prefix (the
        matcher steps through the draft and is rolled back). Returns the logits rows they mask."""
        row_bytes = self.words * 4
        first = bitmask.data_ptr() + start * row_bytes  # pointer arithmetic: no tensor per row
        try:
            for i in range(len(draft) + 1):
                matcher.unsafe_compute_mask_ptr(first + i * row_bytes, row_bytes)
                if i < len(draft) and not matcher.consume_token(draft[i]):
                    raise RuntimeError(f"the grammar refused draft token {draft[i]}: {matcher.get_error()}")
        finally:
            consumed = min(i, len(draft))
            if consumed:
                matcher.rollback(consumed)
        return [offset + i for i in range(len(draft) + 1)]

    def accept(self, req: Request, token: int) -> bool:
        """Consume one kept token of a constrained request; True when its grammar is complete.
        Unconstrained requests: False. A token the grammar refuses raises (the mask forbade it)."""
        matcher = self._matchers.get(req.request_id)
        if matcher is None:
            return False
        if not matcher.consume_token(token):
            raise RuntimeError(f"the grammar refused token {token}: {matcher.get_error()}")
        return bool(matcher.is_stopped())
