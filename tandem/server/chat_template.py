"""Chat templates: jinja2 in an immutable sandbox, as HF tokenizer_config.json templates expect.

A template never gets Python objects beyond plain data (messages, tools, strings, flags), and the
sandbox refuses attribute access to internals and mutation of its inputs, so templates shipped with
a checkpoint cannot run code.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template is missing or invalid (a server setup problem)."""


class ChatRenderError(ValueError):
    """Rendering failed for this request's messages (served as HTTP 400)."""


_MAX_MESSAGE_CHARS = 300  # error messages quote the failure, never a request's whole text
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate_error(text: str) -> str | None:
    """What is wrong with `text` if it holds a lone UTF-16 surrogate (JSON's "\\ud800" parses to
    one): such text has no UTF-8 form, so it can be neither tokenized nor sent back."""
    bad = _LONE_SURROGATE.search(text)
    if bad is None:
        return None
    return (f"the text holds a lone UTF-16 surrogate (U+{ord(bad.group()):04X}) at character {bad.start()}, "
            "which is not valid Unicode; send surrogates in pairs (or the character itself)")


def short_message(e: BaseException) -> str:
    """An exception's message (its type's name when it has none), cut to _MAX_MESSAGE_CHARS."""
    text = str(e) or type(e).__name__
    return text if len(text) <= _MAX_MESSAGE_CHARS else text[: _MAX_MESSAGE_CHARS - 3] + "..."


def _render_failure(e: Exception) -> ChatRenderError:
    """Every way rendering can fail on a request's input, as the one error the server serves as 400."""
    if isinstance(e, RecursionError):
        return ChatRenderError("the chat template recursed too deeply (messages or tools nested too deeply?)")
    if isinstance(e, MemoryError):
        return ChatRenderError("the chat template ran out of memory rendering these messages")
    if isinstance(e, (jinja2.exceptions.TemplateError, OverflowError)):  # OverflowError: "Range too big"
        return ChatRenderError(f"chat template error: {short_message(e)}")
    return ChatRenderError(f"chat template could not render these messages: {type(e).__name__}: {short_message(e)}")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, indent: int | None = None, separators: Any = None, sort_keys: bool = False) -> str:
    # Unlike jinja's own tojson this keeps non-ASCII text readable and does not HTML-escape,
    # which is what HF chat templates are written against.
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def resolve_template_source(arg: str | None, tokenizer_template: str | None) -> str:
    """`--chat-template` is a file path or an inline template; without it the tokenizer's is used."""
    if arg:
        path = Path(arg).expanduser()
        looks_like_path = "{" not in arg and "\n" not in arg
        if looks_like_path:
            try:
                return path.read_text(encoding="utf-8")
            except OSError as e:
                raise ChatTemplateError(f"--chat-template {arg!r}: cannot read file ({e.strerror})") from e
        return arg
    if tokenizer_template:
        return tokenizer_template
    raise ChatTemplateError(
        "this model has no chat template (none in tokenizer_config.json or chat_template.jinja); "
        "pass --chat-template PATH_OR_TEMPLATE to use /v1/chat/completions"
    )


def _message_text(content: Any) -> str | None:
    """Flatten OpenAI content parts ([{type: text, text}]) into one string, as most templates
    (Qwen3's included) expect a string."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ChatRenderError(f"message content must be a string or a list of parts, not {type(content).__name__}")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ChatRenderError(f"unsupported message content part {kind!r}; only text parts are supported")
        texts.append(part["text"])
    return "\n".join(texts)


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Plain-dict messages for the template: text content, tool-call arguments as objects."""
    if not messages:
        raise ChatRenderError("messages must hold at least one message")
    out = []
    for msg in messages:
        if not isinstance(msg, dict):
            raise ChatRenderError(f"each message must be an object, not {type(msg).__name__}")
        msg = {k: v for k, v in msg.items() if v is not None}
        msg["content"] = _message_text(msg.get("content"))
        if msg.get("tool_calls"):
            msg["tool_calls"] = [_tool_call(call) for call in _as_list(msg["tool_calls"], "tool_calls")]
        out.append(msg)
    return out


def _as_list(value: Any, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise ChatRenderError(f"{what} must be a list, not {type(value).__name__}")
    return value


def _tool_call(call: Any) -> dict[str, Any]:
    """OpenAI sends arguments as a JSON string; templates (Qwen3's) print them with tojson, so they
    get the parsed object. Arguments that are not JSON stay the string they are."""
    if not isinstance(call, dict) or not isinstance(call.get("function") or {}, dict):
        raise ChatRenderError("each tool call must be an object with a \"function\" object")
    fn = dict(call.get("function") or {})
    if isinstance(fn.get("arguments"), str):
        try:
            fn["arguments"] = json.loads(fn["arguments"])
        except RecursionError:
            raise ChatRenderError("tool call arguments are nested too deeply") from None
        except ValueError:  # not JSON, or an integer of more digits than Python converts
            pass
    return {**call, "function": fn}


class ChatTemplate:
    """A compiled chat template plus the server's default template kwargs."""

    def __init__(
        self,
        source: str,
        bos_token: str | None = None,
        eos_token: str | None = None,
        default_kwargs: dict[str, Any] | None = None,
    ) -> None:
        try:
            self.template = _environment().from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ChatTemplateError(f"chat template has a syntax error at line {e.lineno}: {e.message}") from e
        except Exception as e:  # jinja folds constants while compiling: `{{ 10**100000 }}` fails here
            raise ChatTemplateError(f"chat template cannot be compiled: {type(e).__name__}: {short_message(e)}") from e
        self.source = source
        self.bos_token = bos_token or ""
        self.eos_token = eos_token or ""
        self.default_kwargs = dict(default_kwargs or {})

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        kwargs: dict[str, Any] | None = None,
    ) -> str:
        """Render the prompt text. Request `kwargs` override the server defaults; the fixed inputs
        (messages, tools, tokens, flags) cannot be overridden by them.

        Raises ChatRenderError, and only that, for anything the request's input makes fail: the
        template's own errors, huge ranges, deep nesting, memory, text that is not valid Unicode.
        It does not bound time: a template may loop for long, so the server renders in
        `text_workers`, which stops a render that runs too long."""
        messages = normalize_messages(messages)
        if continue_final_message and add_generation_prompt:
            raise ChatRenderError("continue_final_message and add_generation_prompt cannot both be true")
        if continue_final_message and messages[-1].get("role") != "assistant":
            raise ChatRenderError("continue_final_message needs the last message to be from the assistant")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise ChatRenderError(f"chat_template_kwargs must be an object, not {type(kwargs).__name__}")
        variables = {**self.default_kwargs, **(kwargs or {})}
        variables.update(
            messages=messages,
            tools=tools or None,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
        )
        try:
            text = self.template.render(**variables)
        except Exception as e:  # a template is a program over the request: any error is the request's
            raise _render_failure(e) from None
        if (bad := lone_surrogate_error(text)) is not None:
            raise ChatRenderError(f"the rendered prompt is not valid text: {bad}")
        if continue_final_message:
            # Cut the template's end-of-turn after the final assistant message, so the model continues it.
            last = messages[-1].get("content") or ""
            cut = text.rfind(last) if last else -1
            if cut >= 0:
                text = text[: cut + len(last)]
        return text
