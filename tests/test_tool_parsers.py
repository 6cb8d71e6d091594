"""Tool-call parsers (tandem/server/tool_parsers.py): the hermes format whole and streamed."""

import json
import logging
import random

import pytest

from tandem.server.tool_parsers import (
    HermesToolParser,
    ToolCall,
    ToolCallDelta,
    ToolDelta,
    get_tool_parser,
    tool_parser_names,
)


def call(name: str, arguments: str, ws: str = "\n") -> str:
    return f'<tool_call>{ws}{{"name": "{name}", "arguments": {arguments}}}{ws}</tool_call>'


WEATHER = call("get_weather", '{"city": "Lima"}')
TIME = call("get_time", '{"tz": "PET"}')
DEMO = '\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n</tool_call>'
NESTED_ARGS = '{"q": {"a": [1, {"b": "}"}], "c": {}}, "s": "</tool_call> } <tool_call> \\" \\\\", "n": null}'
UNICODE_ARGS = '{"city": "São Paulo", "sky": "🌧", "jp": "東京"}'

# output -> (content, [(name, arguments)]) as extract must give them
CASES = {
    "single": (WEATHER, None, [("get_weather", '{"city": "Lima"}')]),
    "demo": (DEMO, None, [("get_weather", '{"city": "Lima"}')]),
    "parallel": (WEATHER + "\n" + TIME + "\n", None, [("get_weather", '{"city": "Lima"}'), ("get_time", '{"tz": "PET"}')]),
    "text_before": ("Let me check.\n\n" + WEATHER, "Let me check.", [("get_weather", '{"city": "Lima"}')]),
    "text_around": ("A <b>\n" + WEATHER + "\n  Done. \n" + TIME + " \n", "A <b>\n  Done.",
                    [("get_weather", '{"city": "Lima"}'), ("get_time", '{"tz": "PET"}')]),
    "compact": ('<tool_call>{"name":"f","arguments":{}}</tool_call>', None, [("f", "{}")]),
    "spaced": ('<tool_call>\n  {\n "name" :\n"f" ,\t"arguments" :  \n {"x": [1, 2]}\n}\n</tool_call>', None,
               [("f", '{"x": [1, 2]}')]),
    "parameters": ('<tool_call>\n{"name": "f", "parameters": {"x": 1}}\n</tool_call>', None, [("f", '{"x": 1}')]),
    "arguments_first": ('<tool_call>\n{"arguments": {"x": 1}, "name": "f"}\n</tool_call>', None, [("f", '{"x": 1}')]),
    "string_arguments": ('<tool_call>\n{"name": "f", "arguments": "{\\"x\\": 1}"}\n</tool_call>', None,
                         [("f", '{"x": 1}')]),
    "extra_key": ('<tool_call>\n{"name": "f", "arguments": {"x": {"y": 1}}, "id": [2]}\n</tool_call>', None,
                  [("f", '{"x": {"y": 1}}')]),
    "nested": (call("search", NESTED_ARGS), None, [("search", NESTED_ARGS)]),
    "unicode": ("Voilà : " + call("get_weather", UNICODE_ARGS), "Voilà :", [("get_weather", UNICODE_ARGS)]),
    "escaped_name": ('<tool_call>{"name": "a\\"b", "arguments": {}}</tool_call>', None, [('a"b', "{}")]),
    "plain_text": ("Hello <tool <b> </tool_call> x\n\n", "Hello <tool <b> </tool_call> x\n\n", []),
    "partial_marker_at_end": ("Hi <tool_ca", "Hi <tool_ca", []),
    "broken_json": ("Hi\n<tool_call>\n{\"name\": \"f\", arguments}\n</tool_call>\n",
                    "Hi\n<tool_call>\n{\"name\": \"f\", arguments}\n</tool_call>\n", []),
    "broken_then_valid": ("<tool_call>{oops}</tool_call>\n" + WEATHER, "<tool_call>{oops}</tool_call>",
                          [("get_weather", '{"city": "Lima"}')]),
    "name_not_string": ('<tool_call>{"name": 3, "arguments": {}}</tool_call>',
                        '<tool_call>{"name": 3, "arguments": {}}</tool_call>', []),
    "no_arguments": ('<tool_call>{"arguments": [], "name": "f"}</tool_call>',
                     '<tool_call>{"arguments": [], "name": "f"}</tool_call>', []),
    "duplicate_key": ('<tool_call>{"arguments": {}, "name": "f", "arguments": {"x": 1}}</tool_call>',
                      '<tool_call>{"arguments": {}, "name": "f", "arguments": {"x": 1}}</tool_call>', []),
    "no_end_marker": ("Ok. " + WEATHER + ' <tool_call>\n{"name": "f", "arguments": {"x"',
                      'Ok. <tool_call>\n{"name": "f", "arguments": {"x"', [("get_weather", '{"city": "Lima"}')]),
}


def parser() -> HermesToolParser:
    return get_tool_parser("hermes")()


def stream(pieces: list[str]) -> tuple[str | None, list[ToolCallDelta], list[ToolCall]]:
    """Feed `pieces` to a fresh parser: (content, call deltas in order, finished calls)."""
    p = parser()
    deltas = [p.delta(piece) for piece in pieces] + [p.flush()]
    content = "".join(d.content or "" for d in deltas)
    return content or None, [c for d in deltas for c in d.calls], p.calls


def reassemble(deltas: list[ToolCallDelta]) -> list[tuple[str, str, str]]:
    """(id, name, arguments) per index from streamed deltas; checks each header comes first."""
    calls: dict[int, list[str]] = {}
    for d in deltas:
        if d.id is not None:
            assert d.index not in calls, "one header per call"
            assert d.name is not None and d.arguments is None
            calls[d.index] = [d.id, d.name, ""]
        else:
            assert d.index in calls, "argument piece before its header"
            assert d.name is None and d.arguments
            calls[d.index][2] += d.arguments
    assert sorted(calls) == list(range(len(calls)))
    return [tuple(calls[i]) for i in sorted(calls)]


def check_split(pieces: list[str], expected: tuple[str | None, list[ToolCall]], orphans_ok: bool = False) -> None:
    content, deltas, calls = stream(pieces)
    assert content == expected[0]
    streamed = reassemble(deltas)
    if orphans_ok:  # a call cut off after its header went out (the documented limitation)
        streamed = [s for s in streamed if s[0] in {c.id for c in calls}]
    assert streamed == [(c.id, c.name, c.arguments) for c in calls]
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in expected[1]]


@pytest.mark.parametrize("case", CASES)
def test_extract(case, caplog):
    text, content, calls = CASES[case]
    with caplog.at_level(logging.WARNING, logger="tandem.server"):
        got_content, got_calls = parser().extract(text)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == calls
    for c in got_calls:
        assert c.id.startswith("call_") and len(c.id) == 29
        assert isinstance(json.loads(c.arguments), dict)
    broken = "<tool_call>" in (content or "")
    assert any("tool call" in r.getMessage() for r in caplog.records) == broken
    assert len({c.id for c in got_calls}) == len(got_calls)


@pytest.mark.parametrize("case", CASES)
def test_stream_matches_extract(case):
    text = CASES[case][0]
    expected = parser().extract(text)
    orphans_ok = case == "no_end_marker"
    check_split([text], expected, orphans_ok)
    check_split(list(text), expected, orphans_ok)
    for i in range(len(text) + 1):
        check_split([text[:i], text[i:]], expected, orphans_ok)
    rng = random.Random(case)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(2, 12))))
        check_split([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])], expected, orphans_ok)


def test_broken_json_logs_and_keeps_text(caplog):
    text = 'Hi <tool_call>\n{"name": "f", "arguments": {"x": 1}\n</tool_call>'  # outer brace missing
    with caplog.at_level(logging.WARNING, logger="tandem.server"):
        assert parser().extract(text) == (text, [])
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "broken tool call" in caplog.records[0].getMessage()


def test_missing_end_marker_at_flush_logs(caplog):
    p = parser()
    with caplog.at_level(logging.WARNING, logger="tandem.server"):
        assert p.delta('\n<tool_call>{"arguments": {"x": ') == ToolDelta(None, ())
        assert p.flush() == ToolDelta('\n<tool_call>{"arguments": {"x": ', ())
    assert p.calls == []
    assert "</tool_call>" in caplog.records[0].getMessage()


def test_header_streams_before_arguments():
    p = parser()
    assert p.delta('<tool_call>\n{"name": "get_weather", "argu') == ToolDelta(None, ())
    head = p.delta('ments": ').calls
    assert len(head) == 1 and head[0].name == "get_weather" and head[0].index == 0
    assert [c.arguments for c in p.delta(' {"city"').calls] == ['{"city"']
    assert [c.arguments for c in p.delta(': "Lima"}}').calls] == [': "Lima"}']  # outer brace held
    assert p.calls == []
    assert p.delta("\n</tool_call>").calls == ()
    assert p.calls == [ToolCall(head[0].id, "get_weather", '{"city": "Lima"}')]
    assert p.flush() == ToolDelta(None, ())


def test_arguments_first_is_held_until_end_marker():
    p = parser()
    assert p.delta('<tool_call>{"arguments": {"x": 1}, "name": "f"}').calls == ()
    header, args = p.delta("</tool_call>").calls
    assert (header.name, header.arguments, args.arguments) == ("f", None, '{"x": 1}')


def test_whole_calls_in_one_delta_with_text():
    p = parser()
    d = p.delta("Sure. " + WEATHER + "\n" + TIME + "\nAnd t")
    assert d.content == "Sure.\nAnd t"
    assert [(c.index, c.name, c.arguments) for c in d.calls] == [
        (0, "get_weather", None), (0, None, '{"city": "Lima"}'), (1, "get_time", None), (1, None, '{"tz": "PET"}'),
    ]
    assert p.delta("ext. \n").content == "ext."
    assert p.flush() == ToolDelta(None, ())  # trailing whitespace dropped: calls were made


def test_break_after_streamed_header_is_content():
    """Documented limitation: the header went out, the raw text still follows as content and the
    index stays used."""
    text = '<tool_call>{"name": "f", "arguments": {"x": 1}</tool_call>' + TIME
    content, deltas, calls = stream([text[:40], text[40:]])
    assert content == '<tool_call>{"name": "f", "arguments": {"x": 1}</tool_call>'
    assert [(c.index, c.name) for c in deltas if c.id] == [(0, "f"), (1, "get_time")]
    assert [c.name for c in calls] == ["get_time"]
    assert parser().extract(text)[0] == content


def test_registry():
    assert {"hermes", "qwen3"} <= set(tool_parser_names())
    assert get_tool_parser("qwen3") is get_tool_parser("hermes") is HermesToolParser
    assert (HermesToolParser.call_begin, HermesToolParser.call_end) == ("<tool_call>", "</tool_call>")
    with pytest.raises(ValueError, match=r"unknown --tool-call-parser 'nope'; choose one of .*hermes, qwen3"):
        get_tool_parser("nope")


def test_to_openai_shapes():
    assert ToolCall("call_1", "f", '{"x": 1}').to_openai() == {
        "id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'},
    }
    assert ToolCallDelta(2, id="call_1", name="f").to_openai() == {
        "index": 2, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": ""},
    }
    assert ToolCallDelta(2, arguments='{"x"').to_openai() == {"index": 2, "function": {"arguments": '{"x"'}}
