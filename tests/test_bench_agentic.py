"""`tandem bench agentic`: per-phase accounting on hand-made streams (exact numbers), tool-call
deltas folded by the client, the conversation builders, then the tool end to end against a fake
server (tool calls, a server that turns tools down) and against a real `tandem serve`."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import httpx
import pytest

# The server stack is a test dependency; a machine without it (the GPU box) skips these tests.
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from tandem.bench import cli as bench_cli
from tandem.bench.client import BenchClient, StreamSample
from tandem.bench.tools import agentic
from tandem.bench.tools.agentic import (build_conversations, phase_seconds, phase_texts, phase_tokens,
                                        reply_messages, split_tokens, tally)
from tandem.server.protocol import ChatCompletionRequest
from serve_proc import start_serve

# ---- per-phase accounting ------------------------------------------------------------------------


def _sample(times, phases, **kw) -> StreamSample:
    return StreamSample(ok=True, start=0.0, end=times[-1], chunk_times=list(times), chunk_phases=list(phases), **kw)


def test_phase_seconds_run_from_the_chunk_before():
    # reasoning 0.5 -> 0.8 (first chunk: TTFT, no time of its own), content 0.8 -> 1.0, tool 1.0 -> 1.5
    s = _sample([0.5, 0.6, 0.8, 1.0, 1.1, 1.5], ["reasoning"] * 3 + ["content"] + ["tool_call"] * 2)
    assert phase_seconds(s) == pytest.approx({"reasoning": 0.3, "content": 0.2, "tool_call": 0.5})
    # a phase in two runs: each run from the chunk before it
    s = _sample([1.0, 1.5, 2.0, 2.25, 3.0], ["reasoning", "content", "content", "reasoning", "content"])
    assert phase_seconds(s) == pytest.approx({"reasoning": 0.25, "content": 1.75})
    assert phase_seconds(_sample([0.3], ["content"])) == {"content": 0.0}
    assert sum(phase_seconds(s).values()) == pytest.approx(s.decode_time)


def test_tally_sums_requests_and_leaves_out_each_first_token():
    a = _sample([0.5, 0.6, 0.8, 1.0, 1.1, 1.5], ["reasoning"] * 3 + ["content"] + ["tool_call"] * 2)
    b = _sample([0.2, 0.3, 0.6], ["content"] * 3)
    totals = tally([a, b], [{"reasoning": 31, "content": 10, "tool_call": 20}, {"content": 5}])
    assert list(totals) == ["reasoning", "content", "tool_call"]
    r, c, t = totals["reasoning"], totals["content"], totals["tool_call"]
    assert (r.tokens, r.decode_tokens) == (31, 30) and r.seconds == pytest.approx(0.3) and r.tok_s == pytest.approx(100.0)
    # content: a's 10 tokens in 0.2 s, b's 5 less its first in 0.4 s
    assert (c.tokens, c.decode_tokens) == (15, 14) and c.seconds == pytest.approx(0.6) and c.tok_s == pytest.approx(14 / 0.6)
    assert (t.tokens, t.decode_tokens) == (20, 20) and t.tok_s == pytest.approx(40.0)
    one = tally([_sample([0.4], ["content"])], [{"content": 1}])["content"]
    assert (one.tokens, one.decode_tokens, one.seconds, one.tok_s) == (1, 0, 0.0, None)


def test_split_tokens_adds_up():
    assert split_tokens(10, {"a": 1, "b": 1, "c": 1}) == {"a": 4, "b": 3, "c": 3}
    assert split_tokens(7, {"reasoning": 300, "content": 100}) == {"reasoning": 5, "content": 2}  # 5.25, 1.75
    assert split_tokens(4, {"content": 0, "tool_call": 0}) == {"content": 4, "tool_call": 0}
    assert sum(split_tokens(101, {"a": 3, "b": 5, "c": 11}).values()) == 101


class _Counter:
    """count_tokens as a server with /tokenize (one token per word) or without (None)."""

    def __init__(self, has_tokenize: bool) -> None:
        self.has_tokenize = has_tokenize
        self.calls: list[tuple[str, bool]] = []

    async def count_tokens(self, text: str, special: bool = True) -> int | None:
        self.calls.append((text, special))
        return len(text.split()) if self.has_tokenize else None


def test_phase_tokens_share_usage_by_tokenize_or_characters():
    calls = [{"index": 0, "id": "c1", "type": "function", "function": {"name": "search", "arguments": '{"q":"ab"}'}}]
    s = _sample([0.1, 0.2, 0.3, 0.4], ["reasoning", "reasoning", "content", "tool_call"], reasoning="one two three",
                text="x", tool_calls=calls, completion_tokens=10)
    assert phase_texts(s) == {"reasoning": "one two three", "content": "x", "tool_call": 'search{"q":"ab"}'}
    counter = _Counter(True)
    tokens, tokenized = asyncio.run(phase_tokens(counter, [s]))
    # weights 3, 1, 1 words -> 10 usage tokens as 6, 2, 2; generated text counted without special tokens
    assert tokenized and tokens == [{"reasoning": 6, "content": 2, "tool_call": 2}]
    assert {special for _, special in counter.calls} == {False}
    s.completion_tokens = None  # no usage: the /tokenize counts as they are
    assert asyncio.run(phase_tokens(counter, [s])) == ([{"reasoning": 3, "content": 1, "tool_call": 1}], True)
    s.completion_tokens = 60  # no /tokenize: characters 13, 1, 16
    tokens, tokenized = asyncio.run(phase_tokens(_Counter(False), [s]))
    assert not tokenized and tokens == [{"reasoning": 26, "content": 2, "tool_call": 32}]


# ---- the client folds tool-call deltas -------------------------------------------------------------


def _events(*deltas: dict, finish: str | None = None, usage: dict | None = None) -> list[str]:
    lines = [f"data: {json.dumps({'choices': [{'index': 0, 'delta': d, 'finish_reason': None}]})}" for d in deltas]
    lines.append(f"data: {json.dumps({'choices': [{'index': 0, 'delta': {}, 'finish_reason': finish}]})}")
    if usage:
        lines.append(f"data: {json.dumps({'choices': [], 'usage': usage})}")
    return lines + ["data: [DONE]"]


_TOOL_STREAM = _events(
    {"role": "assistant", "content": ""},  # the role announcement: not output
    {"reasoning_content": "I should "},
    {"reasoning_content": "look it up."},
    {"content": "Checking."},
    {"tool_calls": [{"index": 0, "id": "call_a", "type": "function", "function": {"name": "search", "arguments": ""}}]},
    {"tool_calls": [{"index": 0, "function": {"arguments": '{"query": '}}]},
    {"tool_calls": [{"index": 0, "function": {"arguments": '"raft"}'}}]},
    {"tool_calls": [{"index": 1, "id": "call_b", "type": "function",
                     "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}]},
    finish="tool_calls", usage={"prompt_tokens": 40, "completion_tokens": 14},
)


def test_read_event_accumulates_tool_calls_and_phases():
    client = BenchClient("http://127.0.0.1:9")
    s = StreamSample(start=0.0)
    try:
        done = [client._read_event(line, s, chat=True) for line in _TOOL_STREAM]
    finally:
        asyncio.run(client.aclose())
    assert done[-1] and not any(done[:-1])
    assert s.reasoning == "I should look it up." and s.text == "Checking." and s.finish_reason == "tool_calls"
    assert s.tool_calls == [
        {"index": 0, "id": "call_a", "type": "function", "function": {"name": "search", "arguments": '{"query": "raft"}'}},
        {"index": 1, "id": "call_b", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}},
    ]
    # the finish-only chunk keeps the phase before it; the usage chunk is no chunk
    assert s.chunk_phases == ["reasoning", "reasoning", "content"] + ["tool_call"] * 5
    assert len(s.chunk_times) == 8 and (s.prompt_tokens, s.completion_tokens) == (40, 14)


def test_read_event_role_with_tool_calls_and_calls_without_index():
    client = BenchClient("http://127.0.0.1:9")
    s = StreamSample(start=0.0)
    lines = _events({"role": "assistant", "tool_calls": [{"id": "x1", "function": {"name": "f", "arguments": '{"a"'}}]},
                    {"tool_calls": [{"function": {"arguments": ": 1}"}}]},
                    {"tool_calls": [{"id": "x2", "function": {"name": "g", "arguments": {"b": 2}}}]})
    try:
        for line in lines:
            client._read_event(line, s, chat=True)
        c = StreamSample(start=0.0)
        for line in ['data: {"choices": [{"text": "ab", "finish_reason": null}]}', "data: [DONE]"]:
            client._read_event(line, c, chat=False)
    finally:
        asyncio.run(client.aclose())
    assert [(x["index"], x["id"], x["function"]["name"], x["function"]["arguments"]) for x in s.tool_calls] == [
        (0, "x1", "f", '{"a": 1}'), (1, "x2", "g", '{"b": 2}')]
    assert s.chunk_phases == ["tool_call"] * 4 and s.text == ""
    assert c.chunk_phases == ["content"] and c.text == "ab"


# ---- conversations ---------------------------------------------------------------------------------


def _valid(messages: list[dict], tools: list[dict] | None) -> None:
    ChatCompletionRequest(model="m", messages=messages, tools=tools)  # raises on a malformed request


def test_builtin_conversations_alternate_and_are_deterministic():
    convs = build_conversations("builtin", 7, 1, 6, 5)
    again = build_conversations("builtin", 7, 1, 6, 5)
    assert [[t.messages for t in c.tasks] for c in convs] == [[t.messages for t in c.tasks] for c in again]
    assert [c.history for c in convs] == [c.history for c in again]
    for c in convs:
        kinds = [t.kind for t in c.tasks]
        assert all(a != b for a, b in zip(kinds, kinds[1:])) and set(kinds[:4]) == set(agentic.KINDS)
        assert all(t.tools == agentic.TOOLS and t.enable_thinking for t in c.tasks)
    first_users = [c.tasks[0].messages[0]["content"] for c in convs]
    assert len(set(first_users)) == len(first_users)  # no two conversations open alike
    other_seed = build_conversations("builtin", 8, 1, 6, 5)
    other_level = build_conversations("builtin", 7, 4, 6, 5)
    assert first_users != [c.tasks[0].messages[0]["content"] for c in other_seed]
    assert first_users != [c.tasks[0].messages[0]["content"] for c in other_level]


def test_history_carries_calls_and_canned_results_not_reasoning():
    conv = build_conversations("builtin", 0, 1, 1, 3)[0]
    first = conv.request(0)
    assert [m["role"] for m in first] == ["system", "user"]
    calls = [{"index": 0, "id": "call_a", "type": "function", "function": {"name": "run_python", "arguments": '{"code": "1"}'}},
             {"index": 1, "id": None, "type": "function", "function": {"name": "search", "arguments": '{"query": "q"}'}}]
    conv.record(0, _sample([0.1, 0.2], ["reasoning", "tool_call"], reasoning="secret plan", text="", tool_calls=calls))
    second = conv.request(1)
    assert [m["role"] for m in second] == ["system", "user", "assistant", "tool", "tool", "user"]
    assistant = second[2]
    assert "reasoning_content" not in assistant and "secret plan" not in json.dumps(second)
    ids = [c["id"] for c in assistant["tool_calls"]]
    assert ids[0] == "call_a" and ids[1] and ids[1] != ids[0]  # the call without an id got one
    assert [m["tool_call_id"] for m in second[3:5]] == ids
    assert json.loads(second[3]["content"]) == {"stdout": "4096\n", "exit_code": 0}
    assert second[5] == conv.tasks[1].messages[0]
    _valid(second, agentic.TOOLS)
    conv.record(1, StreamSample(ok=False, error="HTTP 500: boom"))  # a failed turn leaves no trace
    third = conv.request(2)
    assert third[:5] == second[:5] and third[5:] == conv.tasks[2].messages
    conv.record(2, _sample([0.1], ["content"], text="done"))
    assert conv.history[-1] == {"role": "assistant", "content": "done"}
    assert reply_messages(_sample([0.1], ["content"], text="hi"), "p") == [{"role": "assistant", "content": "hi"}]


def test_demo_conversations_are_corpus_prompts():
    from tandem.demo.corpus import TOOLS as DEMO_TOOLS

    convs = build_conversations("demo", 0, 1, 3, 4)
    assert convs == build_conversations("demo", 0, 1, 3, 4)
    for c in convs:
        assert not c.carry_history and sorted(t.kind for t in c.tasks) == sorted(agentic.KINDS)
        for t, task in enumerate(c.tasks):
            messages = c.request(t)
            assert messages == task.messages and messages[-1]["role"] == "user"
            assert all(m["role"] in ("system", "user") for m in messages)
            assert (task.tools is DEMO_TOOLS) == (task.kind == "tool")
            _valid(messages, task.tools)
            c.record(t, _sample([0.1], ["content"], text="x"))
        assert c.history == []  # independent turns
    reasoning = [t.messages[-1]["content"] for c in convs for t in c.tasks if t.kind == "reasoning"]
    code = [t.messages[-1]["content"] for c in convs for t in c.tasks if t.kind == "code"]
    assert all("Python" in q for q in code) and len(set(reasoning)) == len(reasoning)


# ---- end to end against a fake server ------------------------------------------------------------


class _FakeServer:
    """An OpenAI-compatible server in an httpx MockTransport: a tool task's answer is a tool call
    (when tools were offered), every other answer reasoning then content. `reject_tools`: tools
    get HTTP 400, as vLLM without --enable-auto-tool-choice."""

    def __init__(self, reject_tools: bool = False) -> None:
        self.reject_tools = reject_tools
        self.bodies: list[dict] = []
        self.drafts = 0.0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "fake", "max_model_len": 4096}]})
        if path == "/tokenize":
            return httpx.Response(200, json={"count": len(json.loads(request.content)["prompt"].split())})
        if path == "/metrics":
            self.drafts += 1
            return httpx.Response(200, text=f'tandem:spec_decode_num_drafts_total{{phase="reasoning"}} {self.drafts}\n'
                                            f'tandem:spec_decode_num_draft_tokens_total{{phase="reasoning"}} {3 * self.drafts}\n'
                                            f'tandem:spec_decode_num_accepted_tokens_total{{phase="reasoning"}} {self.drafts}\n')
        body = json.loads(request.content)
        self.bodies.append(body)
        if body.get("tools") and self.reject_tools:
            return httpx.Response(400, json={"error": {"message": '"auto" tool choice needs --enable-auto-tool-choice'}})
        user = [m for m in body["messages"] if m["role"] == "user"][-1]["content"]
        if body.get("tools") and " tool" in user:
            n = len(self.bodies)
            deltas = [{"reasoning_content": "A tool "}, {"reasoning_content": "answers this."},
                      {"tool_calls": [{"index": 0, "id": f"call_{n}", "type": "function",
                                       "function": {"name": "search", "arguments": ""}}]},
                      {"tool_calls": [{"index": 0, "function": {"arguments": '{"query": "x y"}'}}]}]
            finish, usage = "tool_calls", 8
        else:
            deltas = [{"reasoning_content": "one two "}, {"reasoning_content": "three"}, {"content": "four five"},
                      {"content": " six"}]
            finish, usage = "stop", 6
        lines = _events({"role": "assistant", "content": ""}, *deltas, finish=finish,
                        usage={"prompt_tokens": 50, "completion_tokens": usage})
        return httpx.Response(200, text="\n\n".join(lines) + "\n\n", headers={"content-type": "text/event-stream"})


def _run_fake(server: _FakeServer, *argv: str):
    args = bench_cli.build_parser().parse_args(["agentic", "--quiet", *argv])

    async def go():
        client = BenchClient("http://fake")
        await client.http.aclose()
        client.http = httpx.AsyncClient(transport=httpx.MockTransport(server))
        try:
            await client.connect()
            return await agentic.run(client, args)
        finally:
            await client.aclose()

    return asyncio.run(go())


def test_fake_server_tool_calls_and_per_phase_rows():
    server = _FakeServer()
    res = _run_fake(server, "--conversations", "3", "--turns", "4", "--concurrency", "1,2", "--seed", "1")
    assert (res.total, res.failed) == (24, 0) and len(res.samples) == 24
    assert [s["concurrency"] for s in res.samples] == [1] * 12 + [2] * 12
    assert {(s["conversation"], s["turn"]) for s in res.samples if s["concurrency"] == 2} == {
        (c, t) for c in range(3) for t in range(4)}
    tool_turns = [s for s in res.samples if s["kind"] == "tool"]
    assert len(tool_turns) == 6 and all(s["finish_reason"] == "tool_calls" for s in tool_turns)
    for s in res.samples:
        assert s["tools"] and sum(s["phase_tokens"].values()) == s["completion_tokens"]
    for s in tool_turns:  # 8 usage tokens over 4 words of reasoning, 3 of name + arguments: 4.57, 3.43
        assert s["phase_tokens"] == {"reasoning": 5, "tool_call": 3}
    # every request sent the tools with "auto"; after a call the next request sent its result back
    assert all(b["tools"] == agentic.TOOLS and b["tool_choice"] == "auto" for b in server.bodies)
    assert all("chat_template_kwargs" not in b for b in server.bodies)
    followed = [b for b in server.bodies if any(m["role"] == "tool" for m in b["messages"])]
    assert followed
    for b in followed:
        msgs = b["messages"]
        for i, m in enumerate(msgs):
            if m["role"] == "tool":
                assert msgs[i - 1]["role"] == "assistant" and msgs[i - 1]["tool_calls"][0]["id"] == m["tool_call_id"]
        assert all("reasoning_content" not in m for m in msgs)
    rows = {(r[0], r[1]): r for r in res.rows}
    assert set(rows) == {(c, p) for c in (1, 2) for p in ("reasoning", "content", "tool_call", "all")}
    tokens = [s["completion_tokens"] for s in res.samples if s["concurrency"] == 1]
    assert rows[(1, "all")][2] == sum(tokens) and rows[(1, "all")][7] == "12/12"
    assert sum(rows[(1, p)][2] for p in ("reasoning", "content", "tool_call")) == sum(tokens)
    assert len(res.headline.values) == 2 and res.headline.name == "aggregate tok/s"
    assert res.summary["tokens_by"] == "tokenize"
    assert [lv["spec"]["phases"]["reasoning"]["drafts"] for lv in res.summary["levels"]] == [1.0, 1.0]
    assert res.summary["lines"][0].startswith("speculative decoding (server /metrics")
    assert not any("turned down tools" in n for n in res.notes)
    json.dumps(res.to_dict())  # what --json writes


def test_fake_server_that_turns_tools_down_falls_back():
    server = _FakeServer(reject_tools=True)
    res = _run_fake(server, "--conversations", "2", "--turns", "2", "--concurrency", "1", "--no-think")
    assert (res.total, res.failed) == (4, 0)
    assert sum(1 for b in server.bodies if "tools" in b) == 1  # the first request only, then retried without
    assert all(b["chat_template_kwargs"] == {"enable_thinking": False} for b in server.bodies)
    assert not any(s["tools"] for s in res.samples)
    assert any("turned down tools" in n and "enable-auto-tool-choice" in n for n in res.notes)
    assert "failed requests" not in res.render()


# ---- end to end against a real server --------------------------------------------------------------


@pytest.fixture(scope="module")
def server():
    from tandem.builtin import ensure_builtin_model

    ensure_builtin_model()
    proc, url = start_serve("tandem-builtin", "--max-model-len", "2048", "--kv-cache-memory", "128MiB", "--device", "cpu")
    yield url
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


@pytest.mark.parametrize("source", ["builtin", "demo"])
def test_agentic_against_tandem_serve(server, source, capsys, tmp_path):
    out = tmp_path / "agentic.json"
    rc = bench_cli.main(["agentic", "--url", server, "--conversations", "1", "--turns", "2", "--concurrency", "1",
                         "--max-tokens", "8", "--source", source, "--json", str(out), "--quiet"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "tok/s" in text and "all" in text
    data = json.loads(out.read_text())
    assert data["tool"] == "agentic" and data["failed"] == 0 and data["total"] == 2
    assert [(s["conversation"], s["turn"]) for s in data["samples"]] == [(0, 0), (0, 1)]
    for s in data["samples"]:
        assert s["ok"] and 1 <= s["completion_tokens"] <= 8
        assert sum(s["phase_tokens"].values()) == s["completion_tokens"]
        assert len(s["chunk_phases"]) == len(s["chunk_times"])
    assert len(data["headline"]["values"]) == 1 and data["summary"]["tokens_by"] == "tokenize"
    if source == "builtin":  # the second turn carried the first one's answer
        assert data["samples"][1]["prompt_tokens"] > data["samples"][0]["prompt_tokens"]
