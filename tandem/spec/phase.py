"""Per-request phase tracking: is the request reasoning, writing its answer, or writing a tool call?

The draft depth that pays off differs by phase (reasoning text is less predictable than an answer
that quotes the prompt, a tool call's JSON more predictable still), so the K controller keys its
statistics on the phase this module reports. The phase is read from token ids, per request:

- "reasoning": inside a `<think>` block that the model opened, or that the template opened at the
  very end of the generation prompt (`...<|im_start|>assistant\\n<think>\\n`, as DeepSeek-R1 and the
  Qwen3 thinking-2507 templates write it).
- "content": the answer. `</think>` switches to it and the switch is sticky: once the reasoning
  block is closed, a later `<think>` (quoted in the answer, or in code) does not reopen reasoning.
  A request whose prompt opened nothing starts here, and a generated `<think>` (Qwen3's hybrid
  models open the block themselves) switches to reasoning as long as no `</think>` or tool call
  came first.
- "tool_call": between a tool-call begin marker (`<tool_call>`, DeepSeek's
  `<｜tool▁calls▁begin｜>`) and its end marker; after the end marker the request is in content. A
  begin marker also ends reasoning (the fallback switch for a model that calls a tool without
  closing its `</think>`), stickily, like `</think>`. Tool calls are their own phase because their
  acceptance differs from prose; a controller without a K for "tool_call" can use content's.

Only the tokens the request generated move the phase, never the prompt: an agent's prompt holds the
reasoning and tool calls of earlier turns, and a user may quote `<think>`. The one exception is the
prompt's *trailing* marker: the marker the prompt ends with, ignoring whitespace tokens, is where
the template left the generation — `<think>` (an open block: reasoning), `</think>` (thinking
switched off, Qwen3's `enable_thinking=False` writes `<think>\\n\\n</think>\\n\\n`: sticky content) or
a tool-call begin (a forced tool call). This is the token form of the rule
`tandem/server/reasoning.py`'s Qwen3ReasoningParser applies to the prompt text
(`prompt.rstrip().endswith("</think>")`), so the two agree on where an answer starts. (The parser
also counts text generated before a model-opened `<think>` as reasoning; the tracker calls it
content until the `<think>` arrives — in practice the model's first token.)

Marker ids come from the tokenizer (`PhaseMarkers.from_tokenizer`). A marker string that is one
token of the vocabulary (an added token, as in Qwen3, DeepSeek and the demo model) is matched as
that id: exact, and a plain-text "<think>" spelt with ordinary pieces does not count. A marker that
is not one token is matched in the decoded text of the generated tokens instead, also when it is
split across `update` calls. (Text, not the id sequence `encode(marker)`: a byte-level BPE merges
a marker's edges with its neighbours — Qwen's pre-tokenizer makes ">\\n\\n" one piece — so the
encoded sequence rarely appears in real output. Each token is decoded on its own, which is right
for ASCII markers; a non-ASCII marker split inside a character is not found.) Tracking degrades
gracefully where markers are missing: a model that does not reason never writes `<think>`, token or
text, so its requests stay in content; a kind given no strings is not tracked (no think markers:
never reasoning; no tool-call markers: no tool_call phase, only `</think>` ends reasoning; none at
all: every request is content).

Feed `update` only the tokens a request keeps (after verification), in order; rejected draft
tokens must not be fed.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from itertools import accumulate
from typing import Literal

from tandem.tokenizer import Tokenizer

Phase = Literal["reasoning", "content", "tool_call"]
REASONING: Phase = "reasoning"
CONTENT: Phase = "content"
TOOL_CALL: Phase = "tool_call"
PHASES: tuple[Phase, ...] = (REASONING, CONTENT, TOOL_CALL)

# The conventional marker strings, per kind; each is looked up in the tokenizer.
THINK_START = ("<think>",)
THINK_END = ("</think>",)
TOOL_CALL_START = ("<tool_call>", "<｜tool▁calls▁begin｜>")
TOOL_CALL_END = ("</tool_call>", "<｜tool▁calls▁end｜>")

_Kind = Literal["think_start", "think_end", "tool_call_start", "tool_call_end"]
_KINDS: tuple[_Kind, ...] = ("think_start", "think_end", "tool_call_start", "tool_call_end")
_TRAILING_SCAN = 64  # prompt tokens looked at for the trailing marker (whitespace included)


@dataclass(frozen=True)
class PhaseMarkers:
    """The marker ids of each kind (tokens of the vocabulary), the markers matched as decoded text
    (those that are not one token) with the text of every id they need, and the ids of the tokens
    that decode to whitespace only (skipped when looking for the prompt's trailing marker). A kind
    with neither ids nor text is not tracked. Built once per model, shared by its requests."""

    think_start: frozenset[int] = frozenset()
    think_end: frozenset[int] = frozenset()
    tool_call_start: frozenset[int] = frozenset()
    tool_call_end: frozenset[int] = frozenset()
    text: tuple[tuple[_Kind, str], ...] = ()
    token_texts: tuple[str, ...] = field(default=(), repr=False)  # decoded id -> text; for `text`
    whitespace_ids: frozenset[int] = field(default=frozenset(), repr=False)

    def __post_init__(self) -> None:
        if self.text and not self.token_texts:
            raise ValueError("PhaseMarkers: text markers need token_texts (the decoded text of every id)")
        if any(not marker for _, marker in self.text):
            raise ValueError("PhaseMarkers: a text marker must not be empty")

    @classmethod
    def from_tokenizer(
        cls,
        tokenizer: Tokenizer,
        think_start: Sequence[str] = THINK_START,
        think_end: Sequence[str] = THINK_END,
        tool_call_start: Sequence[str] = TOOL_CALL_START,
        tool_call_end: Sequence[str] = TOOL_CALL_END,
    ) -> PhaseMarkers:
        """Look the marker strings up in `tokenizer`. Per kind, the strings that are one token give
        their ids; when none is, the kind's first string is matched as text. Pass () for a kind
        not to track it. Decodes every id once (about 50 ms for a 150K vocabulary)."""
        ids: dict[str, frozenset[int]] = {}
        text: list[tuple[_Kind, str]] = []
        for kind, strings in zip(_KINDS, (think_start, think_end, tool_call_start, tool_call_end)):
            found = {tid for s in strings if (tid := tokenizer.token_to_id(s)) is not None}
            ids[kind] = frozenset(found)
            if not found and strings:
                text.append((kind, strings[0]))
        singles = [[i] for i in range(tokenizer.vocab_size)]
        texts = tuple(tokenizer.fast.decode_batch(singles, skip_special_tokens=False))
        whitespace = frozenset(i for i, t in enumerate(texts) if t and not t.strip())
        return cls(**ids, text=tuple(text), token_texts=texts if text else (), whitespace_ids=whitespace)

    @property
    def tracks_reasoning(self) -> bool:
        """False when nothing can open reasoning: no request is ever in it."""
        return bool(self.think_start) or any(kind == "think_start" for kind, _ in self.text)

    @cached_property
    def _kind_of_id(self) -> dict[int, _Kind]:
        return {tid: kind for kind in _KINDS for tid in getattr(self, kind)}

    @cached_property
    def _longest_text(self) -> int:
        return max((len(marker) for _, marker in self.text), default=0)

    def _text_of(self, token_ids: Sequence[int]) -> list[str]:
        texts = self.token_texts
        return [texts[t] if 0 <= t < len(texts) else "" for t in token_ids]

    def find(self, token_ids: Sequence[int], text_before: str = "") -> list[_Kind]:
        """The markers among `token_ids`, in order. A text marker may begin in `text_before` (the
        decoded text of the tokens before) but must end in `token_ids`."""
        # (token index, character end within the text or 0 for an id marker, kind): sorted, in order
        events = [(i, 0, kind) for i, t in enumerate(token_ids) if (kind := self._kind_of_id.get(t))]
        if self.text:
            pieces = self._text_of(token_ids)
            joined = text_before + "".join(pieces)
            ends = list(accumulate((len(p) for p in pieces), initial=len(text_before)))  # ends[i + 1]: end of token i
            for kind, marker in self.text:
                at = joined.find(marker, max(0, len(text_before) - len(marker) + 1))
                while at >= 0:
                    end = at + len(marker)
                    token = bisect_left(ends, end, lo=1) - 1  # the token holding the marker's last character
                    events.append((token, end, kind))
                    at = joined.find(marker, at + 1)
        events.sort()
        return [kind for _, _, kind in events]

    def text_tail(self, text_before: str, token_ids: Sequence[int]) -> str:
        """The decoded text a text marker split across calls can begin in (empty without text markers)."""
        keep = self._longest_text - 1
        if keep <= 0:
            return ""
        return (text_before + "".join(self._text_of(token_ids[-keep:])))[-keep:]

    def trailing(self, token_ids: Sequence[int]) -> _Kind | None:
        """The marker `token_ids` ends with, ignoring trailing whitespace tokens; None if none."""
        tail = list(token_ids[-_TRAILING_SCAN:])
        while tail and tail[-1] in self.whitespace_ids:
            tail.pop()
        if not tail:
            return None
        if kind := self._kind_of_id.get(tail[-1]):
            return kind
        if self.text:
            text = "".join(self._text_of(tail)).rstrip()
            for kind, marker in self.text:
                if text.endswith(marker):
                    return kind
        return None


class PhaseTracker:
    """The phase of one request (see the module docstring for the rules).

    `prompt_token_ids` only decides the starting phase, through its trailing marker; then
    `update(new_token_ids)` moves the phase with the generated tokens, any number at a time (a
    speculative step keeps several): every marker among them counts, in order, also a text marker
    split across calls, and the phase after the last token is returned.
    """

    def __init__(self, markers: PhaseMarkers, prompt_token_ids: Sequence[int] = ()) -> None:
        self.markers = markers
        self._phase: Phase = CONTENT
        self._past_reasoning = False  # `</think>` or a tool call seen: reasoning cannot start again
        self._text_tail = ""  # decoded end of the generated text, for a text marker split across updates
        trailing = markers.trailing(prompt_token_ids)
        if trailing is not None:
            self._apply(trailing)

    @property
    def phase(self) -> Phase:
        return self._phase

    def update(self, new_token_ids: Sequence[int]) -> Phase:
        """Consume the tokens the request just kept; returns the phase after them."""
        if not new_token_ids:
            return self._phase
        markers = self.markers
        if not markers.text:  # every marker is one token: a lookup per token (the hot path)
            get = markers._kind_of_id.get
            for token in new_token_ids:
                kind = get(token)
                if kind is not None:
                    self._apply(kind)
            return self._phase
        for kind in self.markers.find(new_token_ids, self._text_tail):
            self._apply(kind)
        if self.markers.text:
            self._text_tail = self.markers.text_tail(self._text_tail, new_token_ids)
        return self._phase

    def _apply(self, kind: _Kind) -> None:
        if kind == "think_start" and not self._past_reasoning:  # sticky: a closed block is not reopened
            self._phase = REASONING
        elif kind == "think_end":
            self._past_reasoning = True
            if self._phase != TOOL_CALL:  # a `</think>` inside a tool call's arguments is text
                self._phase = CONTENT
        elif kind == "tool_call_start":
            self._past_reasoning = True  # the fallback switch out of reasoning
            self._phase = TOOL_CALL
        elif kind == "tool_call_end" and self._phase == TOOL_CALL:
            self._phase = CONTENT
