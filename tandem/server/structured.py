"""A chat request's `response_format` and `tool_choice` as the grammar its output must follow.

The engine enforces grammars (`tandem/engine/structured.py`, a Lark grammar in llguidance's
dialect); this module writes them from the OpenAI fields and checks what OpenAI checks:

- `response_format` (chat, and /v1/completions where the whole text is the JSON): `json_object`
  is any JSON object, `json_schema` a JSON value valid against
  its `schema` (enforced whether or not `strict` is set: a constrained decoder has no cheaper
  "best effort"), `text` nothing.
- `tool_choice`: `"required"` is one or more calls (one when `parallel_tool_calls` is false) of
  the request's tools, each a call of one of them with arguments valid against its `parameters`;
  a named function is one call of that function. The call syntax is the tool-call parser's
  (`ToolParser.call_grammar`). `"auto"` with a `json_schema` or `json_object` format allows
  either that JSON or calls; `"none"` renders no tools and parses no calls.
- The reasoning the model writes first stays free: when the choice's output starts inside
  reasoning (`ReasoningParser.starts_in_reasoning`), the grammar lets any text through up to the
  parser's end tag, then constrains what follows (at most a few line breaks, then the content).

JSON is written in `tandem.engine.structured.JSON_STYLE` (`json_rule`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tandem.engine.structured import json_rule
from tandem.server import errors
from tandem.server.protocol import ChatCompletionRequest, CompletionRequest, NamedToolChoice
from tandem.server.reasoning import ReasoningParser
from tandem.server.tool_parsers import ToolParser
from tandem.tokenizer import Tokenizer

_GAP = r"/[ \t\r\n]{0,8}/"  # whitespace allowed between the parts of an output


@dataclass(frozen=True)
class ToolUse:
    """How a chat request uses its tools: parsed out of the output, and (for "required" or a named
    function) forced by the grammar. Whether the template renders them is
    `protocol.chat_template_inputs`' rule (not with tool_choice "none")."""

    tools: tuple[dict[str, Any], ...] = ()  # the request's tools as OpenAI dicts
    parse: bool = False  # the output's calls are parsed into `tool_calls`
    forced: tuple[int, ...] = ()  # indices into `tools` a call must be one of (empty: no call forced)
    parallel: bool = True

    def forced_tools(self) -> list[dict[str, Any]]:
        return [self.tools[i] for i in self.forced]


def tool_use(req: ChatCompletionRequest, parser: type[ToolParser] | None, auto_enabled: bool) -> ToolUse:
    """The request's tool use under the server's `--tool-call-parser` (`parser`) and
    `--enable-auto-tool-choice`; a combination that cannot be honoured is a 400 naming the field."""
    tools = tuple(t.model_dump(exclude_none=True) for t in req.tools or ())
    choice = req.tool_choice
    parallel = req.parallel_tool_calls is not False
    if not tools:
        if choice == "required" or isinstance(choice, NamedToolChoice):
            raise errors.bad_request("tool_choice needs tools: the request defines none", "tool_choice")
        return ToolUse()
    if choice == "none":
        return ToolUse(tools)
    if choice is None or choice == "auto":
        if parser is not None and auto_enabled:
            return ToolUse(tools, parse=True, parallel=parallel)
        if choice == "auto":
            raise errors.bad_request('"auto" tool choice needs the server started with --enable-auto-tool-choice '
                                     "and --tool-call-parser", "tool_choice")
        return ToolUse(tools)  # tools shown to the model, its text returned as it is
    if parser is None:
        raise errors.bad_request(f"tool_choice {_choice_name(choice)} needs the server started with "
                                 "--tool-call-parser", "tool_choice")
    if isinstance(choice, NamedToolChoice):
        named = [i for i, t in enumerate(tools) if t["function"]["name"] == choice.function.name]
        if not named:
            known = ", ".join(t["function"]["name"] for t in tools)
            raise errors.bad_request(f"tool_choice names function {choice.function.name!r}, which is not among "
                                     f"the request's tools ({known})", "tool_choice")
        return ToolUse(tools, parse=True, forced=(named[0],), parallel=False)
    return ToolUse(tools, parse=True, forced=tuple(range(len(tools))), parallel=parallel)


def _choice_name(choice: Any) -> str:
    return f"function {choice.function.name!r}" if isinstance(choice, NamedToolChoice) else repr(choice)


def marker_writer(tokenizer: Tokenizer) -> Callable[[str], str]:
    """marker(text): a Lark expression for a marker string: the token itself (`<[id]>`) where the
    vocabulary has it as one token (models emit `<tool_call>` as that token, never spelt out),
    else the text."""

    def marker(text: str) -> str:
        token = tokenizer.token_to_id(text)
        return f"<[{token}]>" if token is not None else json.dumps(text)

    return marker


def response_format_schema(req: ChatCompletionRequest | CompletionRequest) -> dict[str, Any] | None:
    """The JSON schema `response_format` asks for (json_object: any object), or None for text."""
    rf = req.response_format
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return {"type": "object"}
    if rf.json_schema is None or rf.json_schema.json_schema is None:
        raise errors.bad_request("response_format json_schema needs json_schema.schema (a JSON schema object)",
                                 "response_format")
    return rf.json_schema.json_schema


def build_grammar(
    req: ChatCompletionRequest,
    use: ToolUse,
    parser: type[ToolParser] | None,
    reasoning: ReasoningParser | None,
    tokenizer: Tokenizer,
) -> tuple[str | None, str]:
    """(The Lark grammar of the request's output, the request field it comes from), or (None, "")
    when the output is free."""
    schema = response_format_schema(req)
    if use.forced and schema is not None:
        raise errors.bad_request("response_format cannot be combined with a forced tool call (tool_choice "
                                 "\"required\" or a named function): the answer is the call", "response_format")
    marker = marker_writer(tokenizer)
    rules = []
    if use.forced:
        assert parser is not None
        rules.append(f"call: {parser.call_grammar(use.forced_tools(), marker, json_rule)}")
        content, field = ("call (gap call)*" if use.parallel else "call"), "tools"
    elif schema is not None:
        rules.append(f"answer: {json_rule(schema)}")
        content, field = "answer", "response_format"
        if use.parse and parser is not None:  # tool_choice auto: the JSON answer, or calls
            rules.append(f"call: {parser.call_grammar(list(use.tools), marker, json_rule)}")
            content = "answer | call (gap call)*" if use.parallel else "answer | call"
    else:
        return None, ""
    head = ""
    if reasoning is not None and reasoning.starts_in_reasoning:
        rules.append(f"think: {marker(reasoning.start_tag)}? /(?s:.*)/ {marker(reasoning.end_tag)}")
        head = "think gap "
    return "\n".join([f"start: {head}({content})", f"gap: {_GAP}", *rules]), field


def check_tool_schemas(use: ToolUse, check: Callable[[str], str | None]) -> None:
    """A 400 naming the first tool of the grammar (the forced ones, or with `parse` all) whose
    `parameters` is not a usable JSON schema; nothing when they all are."""
    for i in use.forced or (range(len(use.tools)) if use.parse else ()):
        tool = use.tools[i]
        params = tool["function"].get("parameters")
        if params is not None:
            error = check(f"start: {json_rule(params)}")
            if error:
                raise errors.bad_request(f"tools[{i}].function.parameters ({tool['function']['name']}) is not a "
                                         f"usable JSON schema: {error}", "tools")
