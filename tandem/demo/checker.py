"""Checks an answer of the demo corpus against what its example expects.

`check(example, answer)` takes the answer text of the final assistant turn (the content after
`</think>`, reasoning removed); `check_tool_call(example, text)` takes the first assistant turn of
a tool-use example and checks the call it makes. Both return a bool and never raise.
"""

from __future__ import annotations

import json
import re
from typing import Any

from tandem.demo.corpus import Example, python_reference, python_tests

_INT = re.compile(r"-?\d+")
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
_CODE = re.compile(r"```python\n(.*?)```", re.S)


def strip_reasoning(text: str) -> str:
    """The answer part of an assistant turn's text: everything after the last `</think>`."""
    return text.split("</think>")[-1].strip()


def _last_json(text: str) -> Any:
    """The first complete JSON array or object in `text` (None if there is none)."""
    dec = json.JSONDecoder()
    for i, ch in enumerate(text):
        if ch in "[{":
            try:
                return dec.raw_decode(text[i:])[0]
            except ValueError:
                continue
    return None


def _check_python(expected: dict[str, Any], answer: str) -> bool:
    m = _CODE.search(answer)
    code = m.group(1) if m else answer
    ns: dict[str, Any] = {}
    try:
        # Only model output of this corpus is run here, with no builtins beyond a safe few.
        safe = {"range": range, "len": len, "abs": abs, "True": True, "False": False}
        exec(compile(code, "<answer>", "exec"), {"__builtins__": safe}, ns)
        fn = ns[expected["name"]]
        ref = python_reference(expected["kind"], expected["k"])
        return all(fn(_copy(t)) == ref(_copy(t)) for t in python_tests(expected["kind"], expected["k"]))
    except Exception:  # noqa: BLE001 - any failure of the model's code is a wrong answer
        return False


def _copy(x: Any) -> Any:
    return list(x) if isinstance(x, list) else x


def check(example: Example, answer: str) -> bool:
    answer = strip_reasoning(answer)
    exp = example.expected
    try:
        if example.family in ("arithmetic", "count", "units", "lookup"):
            nums = _INT.findall(answer.replace(",", ""))
            return bool(nums) and int(nums[-1]) == exp["number"]
        if example.family == "sort":
            return _last_json(answer) == exp["list"]
        if example.family == "json":
            return _last_json(answer) == exp["json"]
        if example.family == "python":
            return _check_python(exp, answer)
        if example.family == "tool":
            return all(s in answer for s in exp["contains"])
        if example.family in ("recall", "names"):  # training-only drills
            return answer == exp["text"] if "text" in exp else int(_INT.findall(answer)[-1]) == exp["number"]
    except Exception:  # noqa: BLE001
        return False
    raise ValueError(f"unknown family {example.family!r}")


def check_tool_call(example: Example, text: str) -> bool:
    m = _TOOL_CALL.search(strip_reasoning(text))
    if not m:
        return False
    try:
        call = json.loads(m.group(1))
    except ValueError:
        return False
    return call == example.expected["call"]


def example_passes(example: Example) -> bool:
    """The example's own assistant turns pass the checker (every generated example must)."""
    turns = [m for m in example.messages if m["role"] == "assistant"]
    if example.family == "tool":
        call = turns[0]["tool_calls"][0]["function"]
        rendered = "<tool_call>\n" + json.dumps({"name": call["name"], "arguments": call["arguments"]}) + "\n</tool_call>"
        return check_tool_call(example, rendered) and check(example, turns[-1]["content"])
    return check(example, turns[-1]["content"])
