"""Tool-call parsers: split a chat answer's content into text and OpenAI tool calls.

Models write calls into their output text between a begin and an end marker. The "hermes" format
(Qwen3, the demo model) puts one JSON object per call between `<tool_call>` and `</tool_call>`:

    Let me check.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Lima"}}
    </tool_call>

A parser is made per generated choice and sees the content text (after the reasoning parser took
the reasoning out). `delta()` consumes streamed text of any length (one character, or several
tokens and whole calls at once under speculative decoding); `flush()` releases what is held back at
the end; `extract()` runs both on a whole text, so streamed and non-streamed responses agree.

Streaming rules:
- Text outside calls is content. A partial begin marker at the end of a delta is held back.
- Whitespace: trailing whitespace of content is held until decided: it is emitted when more
  non-whitespace content follows, dropped when a call begins, and at `flush()` dropped if at least
  one call was parsed, else released (so an answer without calls passes through unchanged). Hence
  whitespace directly before a call, and whitespace-only text between or after calls, is dropped.
- A call's header (index, id, name, arguments "") is sent as soon as its body reads
  `{"name": "<name>", "arguments":`; then the arguments object's raw text is sent in pieces as it
  arrives, ending at its own closing brace. Other key orders, or arguments sent as a JSON string,
  are held and sent whole at the end marker. The finished call's `arguments` is exactly the
  concatenation of its pieces: the raw JSON text the model wrote (or the string's value).
- An end marker inside a JSON string of the body is part of that string.
- A broken call (body not one JSON object with a string "name" and an object "arguments", or no end
  marker when the output ends) is returned as content, raw and with the whitespace before it, and
  logged. Limitation: when the body breaks after its header was streamed, the client has already
  seen that header; its index stays used, and the raw text still follows as content.

Adding a format is one subclass (markers, `parse_call`, optionally `find_end` / `stream_prefix`)
plus `@register("name")`.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tandem.server.reasoning import partial_tag_len

logger = logging.getLogger("tandem.server")

_PARSERS: dict[str, type[ToolParser]] = {}


def register(*names: str):
    def deco(cls: type[ToolParser]) -> type[ToolParser]:
        cls.name = names[0]
        for name in names:
            _PARSERS[name] = cls
        return cls

    return deco


def tool_parser_names() -> list[str]:
    return sorted(_PARSERS)


def get_tool_parser(name: str) -> type[ToolParser]:
    try:
        return _PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown --tool-call-parser {name!r}; choose one of {', '.join(tool_parser_names())}") from None


@dataclass(frozen=True)
class ToolCall:
    """A finished call; `arguments` is JSON text, as OpenAI sends it."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolCallDelta:
    """One streamed piece of call `index`: the header (id and name set, arguments None) comes
    first, then argument pieces (id and name None) whose concatenation is the call's arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str | None = None

    def to_openai(self) -> dict[str, Any]:
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments or ""}}
        function = {"name": self.name, "arguments": self.arguments or ""}
        return {"index": self.index, "id": self.id, "type": "function", "function": function}


@dataclass(frozen=True)
class ToolDelta:
    """What one `delta()` / `flush()` lets the server emit now."""

    content: str | None
    calls: tuple[ToolCallDelta, ...] = ()


class ToolParser(ABC):
    """Streaming machinery shared by all formats; a subclass gives the markers and parses bodies.

    `calls` holds the finished, valid calls so far (`finish_reason` is "tool_calls" when any)."""

    name = ""
    call_begin = ""
    call_end = ""

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.tools = tools or []  # the request's tool definitions (OpenAI dicts); not checked yet
        self.calls: list[ToolCall] = []
        self._buf = ""  # outside a call: a held partial begin marker; inside: the call's body so far
        self._ws = ""  # trailing whitespace of content, held until decided
        self._in_call = False
        self._call_ws = ""  # whitespace dropped before the current call, given back if it breaks
        self._id = ""
        self._index = 0  # index of the current (or next) call
        self._sent: str | None = None  # arguments text streamed for the current call; None: no header yet
        self.begin_call()

    # -- format hooks ---------------------------------------------------------------------------

    @abstractmethod
    def parse_call(self, body: str) -> tuple[str, str] | None:
        """(name, arguments JSON text) of one complete call body (the text between the markers),
        or None when it is broken."""

    def begin_call(self) -> None:
        """A call began: reset the per-call state of `find_end` / `stream_prefix`."""

    def find_end(self, body: str) -> int:
        """Index of the end marker in `body` (the call's text so far, growing), or -1."""
        return body.find(self.call_end)

    def stream_prefix(self, body: str) -> tuple[str, str] | None:
        """(name, arguments text so far) once the name is known, else None. The text must be a
        prefix of `parse_call`'s arguments for any valid completion of `body`. The default holds
        every call until its end marker."""
        return None

    @classmethod
    def call_grammar(cls, tools: list[dict[str, Any]], marker: Callable[[str], str],
                     json_rule: Callable[[dict[str, Any]], str]) -> str:
        """A Lark expression (llguidance's dialect) for one call, in this format, of one of `tools`
        (OpenAI tool dicts) with arguments valid against its `parameters`; the grammar of
        tool_choice "required" or a named function (`tandem/server/structured.py`).
        `marker(text)` writes a marker (as its token where it is one), `json_rule(schema)` a
        JSON value."""
        raise NotImplementedError(f"the {cls.name} tool-call format has no grammar for forced calls")

    # -- streaming ------------------------------------------------------------------------------

    def delta(self, text: str) -> ToolDelta:
        """Consume the next piece of streamed content text; returns what can be emitted now."""
        self._buf += text
        content: list[str] = []
        calls: list[ToolCallDelta] = []
        while self._step_call(content, calls) if self._in_call else self._step_text(content):
            pass
        return ToolDelta("".join(content) or None, tuple(calls))

    def flush(self) -> ToolDelta:
        """The output ended: release held-back text; an unfinished call becomes content."""
        if self._in_call:
            content = self._call_ws + self.call_begin + self._buf
            logger.warning("tool call without %s at the end of the output, returned as content: %.300r",
                           self.call_end, content)
        elif self._buf or not self.calls:
            content = self._ws + self._buf
        else:
            content = ""  # trailing whitespace after calls
        self._buf = self._ws = self._call_ws = ""
        self._in_call = False
        return ToolDelta(content or None)

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole output, on a fresh parser."""
        first, last = self.delta(text), self.flush()
        content = (first.content or "") + (last.content or "")
        return content or None, list(self.calls)

    def _step_text(self, content: list[str]) -> bool:
        """Emit content up to the next begin marker; True when a call began."""
        begin = self._buf.find(self.call_begin)
        if begin < 0:
            cut = len(self._buf) - partial_tag_len(self._buf, self.call_begin)
            self._emit_text(self._buf[:cut], content)
            self._buf = self._buf[cut:]
            return False
        self._emit_text(self._buf[:begin], content)
        self._call_ws, self._ws = self._ws, ""
        self._buf = self._buf[begin + len(self.call_begin) :]
        self._in_call, self._id, self._sent = True, "call_" + uuid.uuid4().hex[:24], None
        self.begin_call()
        return True

    def _step_call(self, content: list[str], calls: list[ToolCallDelta]) -> bool:
        """Stream the current call; True when its end marker was found (text after it remains)."""
        end = self.find_end(self._buf)
        if end < 0:
            prefix = self.stream_prefix(self._buf)
            if prefix is not None:
                self._emit_call(*prefix, calls)
            return False
        body, self._buf = self._buf[:end], self._buf[end + len(self.call_end) :]
        self._in_call = False
        parsed = self.parse_call(body)
        if parsed is None:
            raw = self.call_begin + body + self.call_end
            logger.warning("broken tool call returned as content: %.300r", raw)
            self._emit_text(self._call_ws + raw, content)
            if self._sent is not None:
                self._index += 1  # its header was already streamed: keep that index used
            return True
        self._emit_call(*parsed, calls)
        self.calls.append(ToolCall(self._id, parsed[0], parsed[1]))
        self._index += 1
        return True

    def _emit_text(self, text: str, content: list[str]) -> None:
        text = self._ws + text
        kept = text.rstrip()
        self._ws = text[len(kept) :]
        if kept:
            content.append(kept)

    def _emit_call(self, name: str, arguments: str, calls: list[ToolCallDelta]) -> None:
        """Send the header if not sent yet, then the part of `arguments` not sent yet."""
        if self._sent is None:
            calls.append(ToolCallDelta(self._index, id=self._id, name=name))
            self._sent = ""
        if len(arguments) > len(self._sent):
            calls.append(ToolCallDelta(self._index, arguments=arguments[len(self._sent) :]))
            self._sent = arguments


_WS = re.compile(r"[ \t\n\r]*")  # JSON whitespace
_HEADER = re.compile(
    r'[ \t\n\r]*\{[ \t\n\r]*"name"[ \t\n\r]*:[ \t\n\r]*("(?:[^"\\]|\\.)*")[ \t\n\r]*,'
    r'[ \t\n\r]*"(?:arguments|parameters)"[ \t\n\r]*:'
)
_DECODER = json.JSONDecoder()


def _skip_ws(text: str, i: int) -> int:
    return _WS.match(text, i).end()


def _members(text: str) -> dict[str, tuple[Any, str]] | None:
    """Top-level members of the JSON object `text`: key -> (value, raw value text). None when
    `text` is not one JSON object, or repeats a key (streamed and parsed values could differ)."""
    try:
        if not isinstance(json.loads(text), dict):
            return None
    except (ValueError, RecursionError):
        return None
    # `text` is a valid object now: walk its members for their raw spans
    members: dict[str, tuple[Any, str]] = {}
    i = _skip_ws(text, _skip_ws(text, 0) + 1)  # past "{"
    while text[i] != "}":
        key, i = _DECODER.raw_decode(text, i)
        start = _skip_ws(text, _skip_ws(text, i) + 1)  # past ":"
        value, i = _DECODER.raw_decode(text, start)
        if key in members:
            return None
        members[key] = (value, text[start:i])
        i = _skip_ws(text, i)
        if text[i] == ",":
            i = _skip_ws(text, i + 1)
    return members


@register("hermes", "qwen3")
class HermesToolParser(ToolParser):
    """`<tool_call>{"name": str, "arguments": object}</tool_call>`, as Qwen3 writes it.

    "parameters" is accepted for "arguments" (not both). Arguments given as a JSON string holding
    an object are accepted too; the call's arguments are then that string. Extra keys are ignored.
    """

    call_begin = "<tool_call>"
    call_end = "</tool_call>"

    @classmethod
    def call_grammar(cls, tools: list[dict[str, Any]], marker: Callable[[str], str],
                     json_rule: Callable[[dict[str, Any]], str]) -> str:
        bodies = [
            json_rule({
                "type": "object",
                "properties": {"name": {"const": t["function"]["name"]},
                               "arguments": t["function"].get("parameters") or {"type": "object"}},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            })
            for t in tools
        ]
        return f'{marker(cls.call_begin)} "\\n" ({" | ".join(bodies)}) "\\n" {marker(cls.call_end)}'

    def begin_call(self) -> None:
        # an incremental lexer over the body: scan position, string state, brace depth
        self._pos, self._in_str, self._esc, self._depth = 0, False, False, 0
        self._end = -1
        self._inner_end: int | None = None  # just after the first value nested in the outer object
        self._name: str | None = None
        self._value_at = 0  # where the arguments value starts, up to whitespace

    def find_end(self, body: str) -> int:
        while self._end < 0 and self._pos < len(body):
            c = body[self._pos]
            if self._in_str:
                if self._esc:
                    self._esc = False
                elif c == "\\":
                    self._esc = True
                elif c == '"':
                    self._in_str = False
            elif c == '"':
                self._in_str = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 1 and self._inner_end is None:
                    self._inner_end = self._pos + 1
            elif c == "<":
                if body.startswith(self.call_end, self._pos):
                    self._end = self._pos
                    break
                if self.call_end.startswith(body[self._pos :]):
                    break  # a partial end marker: wait for more text
            self._pos += 1
        return self._end

    def stream_prefix(self, body: str) -> tuple[str, str] | None:
        if self._name is None:
            m = _HEADER.match(body)
            if m is None:
                return None
            try:
                self._name = json.loads(m.group(1))
            except ValueError:
                return None  # e.g. a raw control character: the end marker decides
            self._value_at = m.end()
        start = _skip_ws(body, self._value_at)
        if not body.startswith("{", start):
            return self._name, ""  # value not there yet, or not an object: hold it to the end
        # the arguments object is the first value nested in the outer one, so it ends at _inner_end
        stop = self._inner_end if self._inner_end is not None else self._pos
        return self._name, body[start:stop]

    def parse_call(self, body: str) -> tuple[str, str] | None:
        members = _members(body)
        if members is None:
            return None
        name = members.get("name", (None, ""))[0]
        keys = [key for key in ("arguments", "parameters") if key in members]
        if not isinstance(name, str) or len(keys) != 1:
            return None
        value, raw = members[keys[0]]
        if isinstance(value, str):
            try:
                return (name, value) if isinstance(json.loads(value), dict) else None
            except (ValueError, RecursionError):
                return None
        return (name, raw) if isinstance(value, dict) else None
