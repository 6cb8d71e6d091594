"""Agents against the demo model (fp32, CPU) through the `openai` client: parsed tool calls,
streamed and not, the tool result fed back, `tool_choice` and `response_format` enforced by the
grammar, and the 400s for what cannot be honoured."""

from __future__ import annotations

import asyncio
import json

import pytest

# The server stack is a test dependency; a machine without it (the GPU box) skips these tests.
pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
import torch

from tandem.builtin import demo_model_dir
from tandem.config import CacheConfig, EngineConfig, ModelConfig, ServerConfig, SpecConfig, parse_size
from tandem.demo.corpus import EVAL_SEED, TOOLS, make_example
from tandem.engine.async_engine import AsyncEngine
from tandem.server.app import create_app
from test_server import LiveServer

jsonschema = pytest.importorskip("jsonschema")

CFG = ServerConfig(reasoning_parser="qwen3", tool_call_parser="hermes", enable_auto_tool_choice=True)
WEATHER = [{"role": "user", "content": "What's the weather in Lima right now?"}]
SUM = [{"role": "user", "content": "What is 48213 + 37795?"}]
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"result": {"type": "integer", "minimum": 0, "maximum": 10**7},
                   "checked": {"type": "boolean"}},
    "required": ["result", "checked"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine():
    cfg = EngineConfig(ModelConfig(str(demo_model_dir()), torch.float32, "cpu", max_model_len=2048,
                                   served_model_name="tandem-demo"),
                       cache=CacheConfig(kv_cache_memory=parse_size("64MiB")))
    eng = AsyncEngine.from_config(cfg)
    eng.start()
    yield eng
    asyncio.run(eng.shutdown(1.0))


def _client(engine, cfg: ServerConfig = CFG):
    live = LiveServer(create_app(engine, cfg), cfg)
    return live, openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def client(engine):
    live, oa = _client(engine)
    yield oa
    live.stop()


def _chat(client, messages, **kw):
    return client.chat.completions.create(model="tandem-demo", messages=messages, max_tokens=300, temperature=0, **kw)


def _streamed(client, messages, **kw) -> tuple[str, list[dict], str]:
    """(content, calls reassembled from the deltas, finish_reason) of a streamed chat."""
    content, calls, finish = "", {}, None
    for chunk in _chat(client, messages, stream=True, **kw):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or ():
            if d.index not in calls:  # the header comes first: id, type and name
                assert d.id and d.type == "function" and d.function.name, d
                calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": d.function.arguments or ""}
            else:
                assert d.id is None and not d.function.name
                calls[d.index]["arguments"] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def _schema_of(name: str) -> dict:
    return next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)


def test_a_weather_question_gives_a_parsed_call_streamed_or_not_then_an_answer(client) -> None:
    reply = _chat(client, WEATHER, tools=TOOLS)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert not choice.message.content  # the call is not left in the text
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Lima"}

    content, calls, finish = _streamed(client, WEATHER, tools=TOOLS)
    assert finish == "tool_calls" and not content
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", call.function.arguments)]

    result = {"city": "Lima", "temp_c": 19, "condition": "foggy"}
    follow = WEATHER + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)},
    ]
    answer = _chat(client, follow, tools=TOOLS).choices[0]
    assert answer.finish_reason == "stop" and not answer.message.tool_calls
    assert "19" in answer.message.content and "foggy" in answer.message.content, answer.message.content


def test_content_has_no_leading_blank_line(client) -> None:
    msg = _chat(client, SUM).choices[0].message
    assert msg.reasoning_content and msg.content == "48213 + 37795 = 86008"
    content, _, _ = _streamed(client, SUM)
    assert content == msg.content


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_and_named_always_give_a_schema_valid_call(client, stream) -> None:
    cases = [
        (SUM, "required", {"get_weather", "get_stock_price", "get_population"}),  # no tool fits: one is forced
        (WEATHER, {"type": "function", "function": {"name": "get_population"}}, {"get_population"}),
        (SUM, {"type": "function", "function": {"name": "get_stock_price"}}, {"get_stock_price"}),
    ]
    for messages, choice, names in cases:
        if stream:
            _, calls, finish = _streamed(client, messages, tools=TOOLS, tool_choice=choice)
        else:
            c = _chat(client, messages, tools=TOOLS, tool_choice=choice).choices[0]
            calls = [{"name": t.function.name, "arguments": t.function.arguments} for t in c.message.tool_calls]
            finish = c.finish_reason
        assert finish == "tool_calls" and calls, (choice, calls)
        for call in calls:
            assert call["name"] in names
            jsonschema.validate(json.loads(call["arguments"]), _schema_of(call["name"]))


def test_response_format_json_schema_validates_where_the_free_answer_is_prose(client) -> None:
    free = _chat(client, SUM).choices[0].message.content
    with pytest.raises(json.JSONDecodeError):
        json.loads(free)
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA, "strict": True}}
    msg = _chat(client, SUM, response_format=fmt).choices[0].message
    jsonschema.validate(json.loads(msg.content), ANSWER_SCHEMA)
    assert msg.reasoning_content  # the reasoning stays free and parsed out
    content, _, finish = _streamed(client, SUM, response_format=fmt)
    assert finish == "stop" and content == msg.content
    # json_object: any object. On a question it answers in prose the demo writes one key forever, so
    # this asks one of its JSON tasks (its free answer is JSON too, wrapped in prose or not).
    reshape = make_example(EVAL_SEED, 0, "json").prompt_messages()
    obj = _chat(client, reshape, response_format={"type": "json_object"}).choices[0]
    assert obj.finish_reason == "stop" and isinstance(json.loads(obj.message.content), dict), obj.message.content
    # With tools and tool_choice auto: the JSON answer or calls, never prose.
    both = _chat(client, WEATHER, tools=TOOLS, response_format=fmt).choices[0]
    assert both.message.tool_calls or isinstance(json.loads(both.message.content), dict)


def test_tool_choice_none_renders_no_tools_and_parses_no_calls(client) -> None:
    c = _chat(client, WEATHER, tools=TOOLS, tool_choice="none").choices[0]
    assert not c.message.tool_calls and c.finish_reason in ("stop", "length")


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format", "objekt"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "minProperties": "2"}}}],
      "tool_choice": "required"}, "tools", "tools[0].function.parameters"),
    # The error names the tool by its index among the request's tools, also for a named function.
    ({"tools": [TOOLS[0], {"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools", "tools[1].function.parameters (f)"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", None),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
     "cannot be combined"),
]


@pytest.mark.parametrize("extra,param,words", BAD)
def test_bad_schemas_and_tool_choices_are_400s(client, extra, param, words) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tandem-demo", messages=SUM, max_tokens=5, **extra)
    err = e.value.body
    assert e.value.status_code == 400 and param in (err.get("param") or ""), err
    if words:
        assert words in err["message"], err
    assert _chat(client, SUM).choices[0].message.content  # and the server keeps serving


def test_auto_tool_choice_needs_the_server_flag(engine) -> None:
    cfg = ServerConfig(reasoning_parser="qwen3", tool_call_parser="hermes", enable_auto_tool_choice=False)
    live, oa = _client(engine, cfg)
    try:
        with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice"):
            _chat(oa, WEATHER, tools=TOOLS, tool_choice="auto")
        # Without a tool_choice the tools are shown to the model and its text comes back as it is.
        c = _chat(oa, WEATHER, tools=TOOLS).choices[0]
        assert not c.message.tool_calls and "<tool_call>" in c.message.content
        forced = _chat(oa, WEATHER, tools=TOOLS, tool_choice="required").choices[0]
        assert forced.message.tool_calls and forced.finish_reason == "tool_calls"
    finally:
        live.stop()


def test_streamed_calls_are_whole_when_deltas_carry_several_tokens(engine, client) -> None:
    """Under DSpark speculation one delta holds several tokens (a call's name and arguments may
    arrive together); the reassembled stream is still the non-streamed call, and the same as
    without speculation (greedy, fp32)."""
    cfg = EngineConfig(ModelConfig(str(demo_model_dir()), torch.float32, "cpu", max_model_len=2048,
                                   served_model_name="tandem-demo"),
                       cache=CacheConfig(kv_cache_memory=parse_size("64MiB")),
                       spec=SpecConfig.parse({"method": "dspark", "num_speculative_tokens": 4}))
    spec_engine = AsyncEngine.from_config(cfg)
    spec_engine.start()
    live, oa = _client(spec_engine)
    try:
        want = _chat(client, WEATHER, tools=TOOLS).choices[0].message.tool_calls[0].function
        got = _chat(oa, WEATHER, tools=TOOLS).choices[0].message.tool_calls[0].function
        assert (got.name, got.arguments) == (want.name, want.arguments)
        content, calls, finish = _streamed(oa, WEATHER, tools=TOOLS)
        assert finish == "tool_calls" and not content
        assert [(c["name"], c["arguments"]) for c in calls] == [(want.name, want.arguments)]
        accepted = sum(s.value for m in spec_engine.engine.metrics.registry.collect() for s in m.samples
                       if s.name == "tandem:spec_decode_num_accepted_tokens_total")
        assert accepted > 0  # drafts were kept: some deltas did carry several tokens
    finally:
        live.stop()
        asyncio.run(spec_engine.shutdown(1.0))


def test_completions_take_response_format_too(client) -> None:
    """/v1/completions has no chat parsing: the whole text is the JSON (as vLLM's)."""
    prompt = "<|im_start|>user\nWhat is 48213 + 37795?<|im_end|>\n<|im_start|>assistant\n"
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA}}
    c = client.completions.create(model="tandem-demo", prompt=prompt, max_tokens=60, temperature=0,
                                  extra_body={"response_format": fmt}).choices[0]
    assert c.finish_reason == "stop"
    jsonschema.validate(json.loads(c.text), ANSWER_SCHEMA)
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.completions.create(model="tandem-demo", prompt=prompt, max_tokens=5,
                                  extra_body={"response_format": {"type": "json_schema",
                                                                  "json_schema": {"name": "x", "schema": {"type": 3}}}})
