"""Reasoning parsers: split a chat answer into reasoning and content.

A parser is made per generated choice, from the rendered prompt and the request's chat template
kwargs (both decide whether the output starts inside a reasoning block). `delta()` consumes the
streamed text; `flush()` releases text held back at the end; `extract()` does the same on a full
text, so streamed and non-streamed responses always split the same way.

Content starts at its first character that is not a line break: the blank line a model writes
after its closing tag (`</think>\n\n`) is not part of the answer. Spaces and tabs are kept (an
answer may be indented code).

Adding a parser is one subclass plus `@register("name")`.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from typing import Any

Split = tuple[str | None, str | None]  # (reasoning, content); None where there is none

_PARSERS: dict[str, type[ReasoningParser]] = {}


def register(name: str):
    def deco(cls: type[ReasoningParser]) -> type[ReasoningParser]:
        cls.name = name
        _PARSERS[name] = cls
        return cls

    return deco


def reasoning_parser_names() -> list[str]:
    return sorted(_PARSERS)


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    try:
        return _PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown --reasoning-parser {name!r}; choose one of {', '.join(reasoning_parser_names())}") from None


class ReasoningParser(ABC):
    """One generated choice's split. `start_tag` / `end_tag` delimit the reasoning;
    `starts_in_reasoning` says whether this choice's output begins inside it (the structured-output
    grammar leaves that part free and constrains what follows `end_tag`)."""

    name = ""
    start_tag = ""
    end_tag = ""
    starts_in_reasoning = False

    def __init__(self, prompt: str = "", chat_template_kwargs: dict[str, Any] | None = None) -> None:
        self.prompt = prompt
        self.chat_template_kwargs = chat_template_kwargs or {}
        self._content_started = False

    def _content(self, text: str) -> str:
        """Content as emitted: the line breaks before its first other character are dropped."""
        if not self._content_started:
            text = text.lstrip("\r\n")
            self._content_started = bool(text)
        return text

    @abstractmethod
    def delta(self, text: str) -> Split:
        """Consume the next piece of streamed output; returns what can be emitted now."""

    @abstractmethod
    def flush(self) -> Split:
        """The output ended: release any text held back (e.g. a partial tag)."""

    def extract(self, text: str) -> Split:
        """Split a whole output (on a fresh parser)."""
        r1, c1 = self.delta(text)
        r2, c2 = self.flush()
        reasoning = (r1 or "") + (r2 or "")
        content = (c1 or "") + (c2 or "")
        return reasoning or None, content or None


def partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (a tag split
    across deltas), so it is held back instead of emitted."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class _Mode(enum.Enum):
    START = "start"  # nothing emitted yet: a leading <think> may still arrive
    REASONING = "reasoning"
    CONTENT = "content"


@register("qwen3")
class Qwen3ReasoningParser(ReasoningParser):
    """`<think>reasoning</think>content`, as Qwen3 writes it.

    How the output starts decides the split:
    - thinking switched off (`chat_template_kwargs` `enable_thinking: false`, or the rendered prompt
      already ends with a closed, empty `<think></think>` block): everything is content;
    - otherwise the output starts inside reasoning: a leading `<think>` is dropped (some templates
      put it in the prompt, then the output only closes it), and everything up to `</think>` is
      reasoning. An output that never closes the block (cut by max_tokens) is all reasoning.
    """

    start_tag = "<think>"
    end_tag = "</think>"

    def __init__(self, prompt: str = "", chat_template_kwargs: dict[str, Any] | None = None) -> None:
        super().__init__(prompt, chat_template_kwargs)
        kw = self.chat_template_kwargs
        disabled = kw.get("enable_thinking") is False or kw.get("thinking") is False
        closed_in_prompt = prompt.rstrip().endswith(self.end_tag)
        self.mode = _Mode.CONTENT if (disabled or closed_in_prompt) else _Mode.START
        self.starts_in_reasoning = self.mode is _Mode.START
        self.pending = ""  # held-back text: leading whitespace or a partial tag

    def delta(self, text: str) -> Split:
        buf, self.pending = self.pending + text, ""
        reasoning = content = ""
        if self.mode is _Mode.START:
            head = buf.lstrip()
            if len(head) < len(self.start_tag) and self.start_tag.startswith(head):
                self.pending = buf  # could still become "<think>"
                return None, None
            if head.startswith(self.start_tag):
                buf = head[len(self.start_tag) :]
            self.mode = _Mode.REASONING
        if self.mode is _Mode.REASONING:
            end = buf.find(self.end_tag)
            if end >= 0:
                reasoning, buf = buf[:end], buf[end + len(self.end_tag) :]
                self.mode = _Mode.CONTENT
            else:
                keep = partial_tag_len(buf, self.end_tag)
                reasoning, self.pending, buf = buf[: len(buf) - keep], buf[len(buf) - keep :], ""
        if self.mode is _Mode.CONTENT:
            content = self._content(buf)
        return reasoning or None, content or None

    def flush(self) -> Split:
        rest, self.pending = self.pending, ""
        if not rest:
            return None, None
        if self.mode is _Mode.CONTENT:
            return None, self._content(rest) or None
        return rest, None
