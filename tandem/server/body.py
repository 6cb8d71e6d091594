"""Request bodies parsed as strict JSON, with bounds a client cannot push past.

Python's `json` accepts what JSON does not (NaN, Infinity), turns 1e400 into inf, raises
RecursionError on deep nesting, ValueError past 4,300 digits, and hands lone surrogates ("\\ud800")
through as unencodable strings that break the tokenizer later. Each of those is refused here as an
`InvalidBody` (HTTP 400) when the body is parsed, before any field reaches the engine.
"""

from __future__ import annotations

import json
import math
from typing import Any

# 2^64 has 20 digits: no integer field Tandem reads needs more (seeds are the widest).
MAX_INT_DIGITS = 20


class InvalidBody(ValueError):
    """The body is not JSON Tandem accepts; the message says why."""


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise InvalidBody(f"an integer has {len(text.lstrip('-'))} digits; at most {MAX_INT_DIGITS} are accepted")
    return int(text)


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise InvalidBody(f"the number {text[:40]} is out of range of a 64-bit float")
    return value


def _parse_constant(name: str) -> float:
    raise InvalidBody(f"{name} is not valid JSON (numbers must be finite)")


def _check_tree(value: Any, max_depth: int) -> None:
    """Depth of nesting at most `max_depth`; every string (and key) encodable as UTF-8."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, str):
            _check_text(node)
            continue
        if not isinstance(node, (dict, list)):
            continue
        if depth > max_depth:
            raise InvalidBody(f"the JSON is nested more than {max_depth} levels deep")
        if isinstance(node, dict):
            for key, item in node.items():
                _check_text(key)
                stack.append((item, depth + 1))
        else:
            stack.extend((item, depth + 1) for item in node)


def _check_text(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidBody(f"a string holds a lone UTF-16 surrogate ({text[e.start:e.end]!r} at character "
                          f"{e.start}); send valid Unicode") from None


def parse_json_object(raw: bytes, max_depth: int) -> dict[str, Any]:
    """The body as a JSON object, or InvalidBody."""
    try:
        data = json.loads(raw, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_parse_constant)
    except InvalidBody:
        raise
    except RecursionError:
        raise InvalidBody(f"the JSON is nested more than {max_depth} levels deep") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, a number json cannot convert
        raise InvalidBody(f"The request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise InvalidBody("The request body must be a JSON object")
    _check_tree(data, max_depth)
    return data
