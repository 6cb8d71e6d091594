"""The HTTP server through the real stack: uvicorn on a loopback port, the real engine on the
built-in tiny model, plain HTTP (httpx), raw sockets for disconnects, and the openai client.

Parser and template units run without an engine at the top of the file.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

# The server stack is a test dependency; a machine without it (the GPU box) skips these tests.
pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from tandem.builtin import ensure_builtin_model
from tandem.cli import bind_socket, build_parser, run, uvicorn_config
from tandem.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, ServerConfig, parse_size
from tandem.core import RequestOutput
from tandem.engine.async_engine import AsyncEngine
from tandem.server.app import attach_engine, create_app
from tandem.server.chat_template import ChatRenderError, ChatTemplate, ChatTemplateError, resolve_template_source
from tandem.server.protocol import ChatCompletionRequest
from tandem.server.reasoning import Qwen3ReasoningParser, get_reasoning_parser
from tandem.tokenizer import Tokenizer
from serve_proc import start_serve

pytestmark = pytest.mark.timeout(120)

MAX_MODEL_LEN = 256
API_KEY = "sk-test-key"
USER_HI = [{"role": "user", "content": "Say hi"}]

# ---- units: reasoning parser ---------------------------------------------------------------------

OUTPUTS = [
    "<think>\nweigh options\n</think>\n\nThe answer is 42.",
    "\n<think>a</think>b",
    "only reasoning, cut by max_tokens",
    "plain </think> after reasoning without an opening tag",
    "<think></think>",
    "<thi",
    "",
]


@pytest.mark.parametrize("text", OUTPUTS)
def test_qwen3_streaming_split_matches_full_extract_at_every_cut(text: str) -> None:
    whole = Qwen3ReasoningParser().extract(text)
    for cut in range(len(text) + 1):
        p = Qwen3ReasoningParser()
        parts = [p.delta(text[:cut]), p.delta(text[cut:]), p.flush()]
        reasoning = "".join(r or "" for r, _ in parts) or None
        content = "".join(c or "" for _, c in parts) or None
        assert (reasoning, content) == whole, cut
    # Char-by-char streaming too (tags split across many deltas).
    p = Qwen3ReasoningParser()
    parts = [p.delta(ch) for ch in text] + [p.flush()]
    assert ("".join(r or "" for r, _ in parts) or None, "".join(c or "" for _, c in parts) or None) == whole


def test_qwen3_split_rules() -> None:
    assert Qwen3ReasoningParser().extract(OUTPUTS[0]) == ("\nweigh options\n", "The answer is 42.")
    # The output starts inside reasoning, also when the template put <think> in the prompt.
    assert Qwen3ReasoningParser("<|im_start|>assistant\n<think>\n").extract("r</think>c") == ("r", "c")
    assert Qwen3ReasoningParser().extract("cut short") == ("cut short", None)
    # Thinking switched off: by kwarg, or by a closed empty think block at the end of the prompt.
    assert Qwen3ReasoningParser("", {"enable_thinking": False}).extract("hello") == (None, "hello")
    assert Qwen3ReasoningParser("assistant\n<think>\n\n</think>\n\n").extract("hello") == (None, "hello")
    assert get_reasoning_parser("qwen3") is Qwen3ReasoningParser
    with pytest.raises(ValueError, match="unknown --reasoning-parser"):
        get_reasoning_parser("nope")


# ---- units: chat template ------------------------------------------------------------------------


def test_chat_template_sandbox_helpers_and_kwargs(tmp_path: Path) -> None:
    src = (
        "{% for m in messages %}{{ m.role }}:{{ m.content }}|{% endfor %}"
        "{{ tools | tojson }}|{{ flag }}|{{ bos_token }}"
        "{% if add_generation_prompt %}>{% endif %}"
        "{% for i in range(5) %}{% if i == 2 %}{% break %}{% endif %}{{ i }}{% endfor %}"
    )
    t = ChatTemplate(src, bos_token="<s>", default_kwargs={"flag": "server"})
    parts = [{"role": "user", "content": [{"type": "text", "text": "héllo"}, {"type": "text", "text": "wörld"}]}]
    out = t.render(parts, tools=[{"name": "ü"}], kwargs=None)
    assert out == 'user:héllo\nwörld|[{"name": "ü"}]|server|<s>>01'
    assert "|request|" in t.render(USER_HI, kwargs={"flag": "request"})
    with pytest.raises(ChatRenderError, match="only text"):
        t.render([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
    with pytest.raises(ChatRenderError, match="boom"):
        ChatTemplate("{{ raise_exception('boom') }}").render(USER_HI)
    with pytest.raises(ChatRenderError):  # the sandbox refuses internals
        ChatTemplate("{{ messages.__class__.__mro__ }}").render(USER_HI)
    assert ChatTemplate("{{ strftime_now('%Y') }}").render(USER_HI).isdigit()
    path = tmp_path / "t.jinja"
    path.write_text("from file")
    assert resolve_template_source(str(path), None) == "from file"
    assert resolve_template_source("{{ 1 }}", "tokenizer's") == "{{ 1 }}"
    with pytest.raises(ChatTemplateError, match="--chat-template"):
        resolve_template_source(None, None)
    with pytest.raises(ChatTemplateError, match="syntax error"):
        ChatTemplate("{% for %}")


def test_protocol_ignores_unknown_fields() -> None:
    req = ChatCompletionRequest.model_validate({"messages": USER_HI, "frobnicate": 1, "parallel_tool_calls": True})
    assert req.messages[0].content == "Say hi" and not hasattr(req, "frobnicate")


# ---- the served stack ----------------------------------------------------------------------------


class LiveServer:
    """uvicorn serving `app` from a background thread on an ephemeral loopback port."""

    def __init__(self, app, cfg: ServerConfig) -> None:
        sock = bind_socket("127.0.0.1", 0)
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn_config(app, cfg, "warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def _engine(model_dir: Path, **sched) -> AsyncEngine:
    cfg = EngineConfig(
        ModelConfig(str(model_dir), max_model_len=MAX_MODEL_LEN),
        cache=CacheConfig(kv_cache_memory=parse_size("16MiB")),
        scheduler=SchedulerConfig(**sched),
    )
    engine = AsyncEngine.from_config(cfg)
    engine.start()
    return engine


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return ensure_builtin_model(tmp_path_factory.mktemp("builtin"))


@pytest.fixture(scope="module")
def engine(model_dir):
    eng = _engine(model_dir, max_num_seqs=8)
    yield eng
    asyncio.run(eng.shutdown(1.0))


SERVER_CFG = ServerConfig(reasoning_parser="qwen3", max_n=4, max_request_body_bytes=64 * 1024)


@pytest.fixture(scope="module")
def server(engine):
    live = LiveServer(create_app(engine, SERVER_CFG), SERVER_CFG)
    yield live
    live.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def _error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def _sse(resp: httpx.Response) -> list:
    events = [line[len("data: "):] for line in resp.text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def _wait_idle(engine: AsyncEngine, timeout: float = 10.0) -> None:
    """Every request gone from the engine and all KV blocks back in the pool."""
    kv = engine.engine.kv
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if engine.num_requests == 0 and engine.engine.num_unfinished == 0 and kv.num_free_blocks == kv.num_blocks:
            return
        time.sleep(0.05)
    raise AssertionError(f"engine not idle: {engine.num_requests} streams, {engine.engine.num_unfinished} requests")


def test_health_version_models_metrics(http, engine) -> None:
    assert http.get("/health").status_code == 200
    assert http.get("/version").json()["version"]
    models = http.get("/v1/models").json()
    assert models["object"] == "list"
    assert models["data"][0]["id"] == engine.model_name and models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    metrics = http.get("/metrics")
    assert metrics.status_code == 200 and "text/plain" in metrics.headers["content-type"]
    assert "tandem:http_requests_total" in metrics.text
    assert any(line.startswith("tandem:") and "http_requests" not in line for line in metrics.text.splitlines())


def test_tokenize_detokenize(http, engine) -> None:
    tok = http.post("/tokenize", json={"prompt": "hello world"}).json()
    assert tok["tokens"] == engine.tokenizer.encode("hello world") and tok["count"] == len(tok["tokens"])
    assert tok["max_model_len"] == MAX_MODEL_LEN
    assert http.post("/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"] == "hello world"
    chat = http.post("/tokenize", json={"messages": USER_HI}).json()
    assert chat["count"] > tok["count"]
    # /tokenize renders a conversation exactly as chat completions do (a null field included).
    convo = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi", "name": None},
             {"role": "assistant", "content": "hello", "tool_calls": None}, {"role": "user", "content": "again"}]
    counted = http.post("/tokenize", json={"messages": convo}).json()["count"]
    usage = http.post("/v1/chat/completions", json={"messages": convo, "max_tokens": 1}).json()["usage"]
    assert counted == usage["prompt_tokens"]
    _error(http.post("/tokenize", json={}), 400)
    _error(http.post("/detokenize", json={"tokens": [10**9]}), 400)


def test_completions(http) -> None:
    body = {"prompt": "Once upon", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    resp = http.post("/v1/completions", json=body).json()
    assert resp["id"].startswith("cmpl-") and resp["object"] == "text_completion"
    choice = resp["choices"][0]
    assert choice["finish_reason"] == "length" and choice["text"]
    assert resp["usage"]["completion_tokens"] == 5
    assert resp["usage"]["total_tokens"] == resp["usage"]["prompt_tokens"] + 5
    assert "cached_tokens" in resp["usage"]["prompt_tokens_details"]
    again = http.post("/v1/completions", json=body).json()  # greedy is deterministic; prefix cache hit
    assert again["choices"][0]["text"] == choice["text"]
    # Batched prompts (text and token ids) times n: indices run prompt-major.
    batch = http.post("/v1/completions", json={"prompt": [[5, 6, 7], [8, 9]], "n": 2, "max_tokens": 3}).json()
    assert [c["index"] for c in batch["choices"]] == [0, 1, 2, 3]
    assert batch["usage"]["prompt_tokens"] == 5 and batch["usage"]["completion_tokens"] <= 12
    seeded = {"prompt": "Once upon", "max_tokens": 6, "temperature": 1.0, "seed": 7, "n": 2}
    first = [c["text"] for c in http.post("/v1/completions", json=seeded).json()["choices"]]
    assert first[0] != first[1]  # each choice gets its own seed...
    assert [c["text"] for c in http.post("/v1/completions", json=seeded).json()["choices"]] == first  # ...repeatably
    echo = http.post("/v1/completions", json={**body, "echo": True}).json()
    assert echo["choices"][0]["text"] == "Once upon" + choice["text"]


def test_completions_logprobs_and_stream(http) -> None:
    body = {"prompt": "Once upon", "max_tokens": 4, "temperature": 0, "ignore_eos": True, "logprobs": 2}
    lp = http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 4
    assert all(len(t) <= 2 for t in lp["top_logprobs"]) and lp["text_offset"][0] == 0
    stream = http.post("/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}})
    assert stream.headers["content-type"].startswith("text/event-stream")
    chunks = _sse(stream)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    streamed = "".join(c["choices"][0]["text"] for c in chunks[:-1])
    whole = http.post("/v1/completions", json={**body, "logprobs": None}).json()["choices"][0]["text"]
    assert streamed == whole
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


def test_chat_non_streaming_reasoning_and_logprobs(http) -> None:
    body = {"messages": USER_HI, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    resp = http.post("/v1/chat/completions", json=body).json()
    assert resp["id"].startswith("chatcmpl-") and resp["object"] == "chat.completion"
    msg = resp["choices"][0]["message"]
    # Thinking is on: the output starts inside reasoning; this random model never closes it.
    assert msg["role"] == "assistant" and msg["reasoning_content"] and msg["reasoning"] == msg["reasoning_content"]
    assert msg["content"] is None
    off = {**body, "chat_template_kwargs": {"enable_thinking": False}}
    msg = http.post("/v1/chat/completions", json=off).json()["choices"][0]["message"]
    assert msg["content"] and msg.get("reasoning_content") is None
    lp = http.post("/v1/chat/completions", json={**body, "logprobs": True, "top_logprobs": 3}).json()
    content = lp["choices"][0]["logprobs"]["content"]
    assert len(content) == 6
    assert set(content[0]) >= {"token", "logprob", "bytes", "top_logprobs"} and len(content[0]["top_logprobs"]) == 3
    # max_completion_tokens wins over max_tokens; n choices.
    many = http.post("/v1/chat/completions", json={**body, "max_completion_tokens": 2, "n": 3, "temperature": 1}).json()
    assert len(many["choices"]) == 3 and many["usage"]["completion_tokens"] == 6


def test_chat_streaming_matches_non_streaming(http) -> None:
    body = {"messages": USER_HI, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    whole = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    chunks = _sse(http.post("/v1/chat/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}}))
    assert chunks[0]["object"] == "chat.completion.chunk" and chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8
    deltas = [c["choices"][0]["delta"] for c in chunks[1:-1]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == whole["reasoning_content"]
    assert "".join(d.get("content", "") for d in deltas) == (whole["content"] or "")
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    plain = _sse(http.post("/v1/chat/completions", json={**body, "stream": True}))
    assert all(c["choices"] for c in plain) and "usage" not in plain[-1]


class ScriptedEngine:
    """Replays a fixed text as engine deltas (for outputs a random model will not write)."""

    def __init__(self, tokenizer: Tokenizer, pieces: list[str]) -> None:
        self.tokenizer, self.pieces = tokenizer, pieces
        self.model_name, self.max_model_len, self.is_dead = "scripted", MAX_MODEL_LEN, False
        self.metrics_registry = None

    async def generate(self, request_id, prompt_token_ids, params):
        for i, piece in enumerate(self.pieces):
            last = i == len(self.pieces) - 1
            yield RequestOutput(request_id, [i], piece, last, "stop" if last else None,
                                num_prompt_tokens=len(prompt_token_ids), num_output_tokens=i + 1)


def test_reasoning_split_through_http(model_dir) -> None:
    pieces = ["<th", "ink>\nLet me", " think.</", "think>\n\nThe answer", " is 42."]
    app = create_app(ScriptedEngine(Tokenizer.from_dir(model_dir), pieces), SERVER_CFG)
    live = LiveServer(app, SERVER_CFG)
    try:
        with httpx.Client(base_url=live.url, timeout=30) as client:
            msg = client.post("/v1/chat/completions", json={"messages": USER_HI}).json()["choices"][0]["message"]
            assert (msg["reasoning_content"], msg["reasoning"], msg["content"]) == (
                "\nLet me think.", "\nLet me think.", "The answer is 42.")
            chunks = _sse(client.post("/v1/chat/completions", json={"messages": USER_HI, "stream": True}))
            deltas = [c["choices"][0]["delta"] for c in chunks[1:]]
            assert "".join(d.get("reasoning_content", "") for d in deltas) == "\nLet me think."
            assert "".join(d.get("content", "") for d in deltas) == "The answer is 42."
            assert not any("<think>" in d.get("content", "") + d.get("reasoning", "") for d in deltas)
    finally:
        live.stop()


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
        ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
        ("/v1/completions", {"prompt": "x", "max_tokens": -1}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "logprobs": 50}, "logprobs"),
        ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
        ("/v1/completions", {"prompt": "x", "n": 5}, "n"),  # above ServerConfig.max_n
        ("/v1/completions", {"prompt": ""}, "prompt"),
        ("/v1/completions", {"prompt": [10**9]}, "prompt"),
        ("/v1/completions", {"max_tokens": 3}, "prompt"),
        ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
        ("/v1/chat/completions", {"messages": "hi"}, "messages"),
        ("/v1/chat/completions", {"messages": USER_HI, "top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": USER_HI, "model": "gpt-4"}, "model"),
    ],
)
def test_bad_requests_are_400(http, path, body, param) -> None:
    err = _error(http.post(path, json=body), 400)
    assert err["param"] == param and err["code"] == 400 and err["message"]


def test_unknown_model_and_malformed_json(http) -> None:
    err = _error(http.post("/v1/completions", json={"prompt": "x", "model": "nope"}), 400)
    assert err["message"] == "The model `nope` does not exist."
    err = _error(http.post("/v1/chat/completions", content=b'{"messages": [', headers={"content-type": "application/json"}), 400)
    assert "not valid JSON" in err["message"]
    _error(http.post("/v1/completions", content=b"[1, 2]"), 400)


def test_context_too_long_uses_vllm_wording(http, engine) -> None:
    n = len(engine.tokenizer.encode("hello world"))
    err = _error(http.post("/v1/completions", json={"prompt": "hello world", "max_tokens": MAX_MODEL_LEN}), 400)
    assert err["message"] == (
        f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, you requested "
        f"{n + MAX_MODEL_LEN} tokens ({n} in the messages, {MAX_MODEL_LEN} in the completion). "
        "Please reduce the length of the messages or completion."
    )
    long_chat = [{"role": "user", "content": "word " * MAX_MODEL_LEN}]
    err = _error(http.post("/v1/chat/completions", json={"messages": long_chat, "max_tokens": 4}), 400)
    assert err["message"].startswith(f"This model's maximum context length is {MAX_MODEL_LEN} tokens.")
    assert http.get("/health").status_code == 200  # one bad request affects nothing else


def test_oversized_body_and_headers(http, server) -> None:
    big = {"prompt": "x" * (SERVER_CFG.max_request_body_bytes + 10)}
    err = _error(http.post("/v1/completions", json=big), 413)
    assert str(SERVER_CFG.max_request_body_bytes) in err["message"]

    def chunked():  # no Content-Length: the limit is enforced while counting streamed bytes
        for _ in range(SERVER_CFG.max_request_body_bytes // 4096 + 2):
            yield b" " * 4096

    _error(http.post("/v1/completions", content=chunked(), headers={"content-type": "application/json"}), 413)
    resp = http.get("/health", headers={"x-huge": "a" * (SERVER_CFG.max_header_bytes + 1024)})
    assert resp.status_code in (400, 431)
    assert http.get("/health").status_code == 200


def _aborted(engine: AsyncEngine) -> float:
    labels = {"model_name": engine.model_name, "finished_reason": "abort"}
    return engine.metrics_registry.get_sample_value("tandem:request_success_total", labels) or 0.0


def test_client_disconnect_aborts_streaming_and_non_streaming(server, engine) -> None:
    for stream in (True, False):
        aborted = _aborted(engine)
        body = json.dumps({"prompt": "go", "max_tokens": MAX_MODEL_LEN - 8, "ignore_eos": True, "stream": stream})
        sock = socket.create_connection(("127.0.0.1", server.port))
        sock.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n{body}".encode()
        )
        deadline = time.monotonic() + 10
        while engine.engine.num_unfinished == 0:  # wait until the engine runs it
            assert time.monotonic() < deadline
            time.sleep(0.01)
        if stream:
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        sock.close()
        _wait_idle(engine)
        assert _aborted(engine) == aborted + 1, "the request ran to the end instead of being aborted"


def test_queue_full_is_503_with_retry_after(model_dir) -> None:
    eng = _engine(model_dir, max_num_seqs=1, max_queued_requests=1)
    cfg = ServerConfig()
    live = LiveServer(create_app(eng, cfg), cfg)

    async def fire() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=live.url, timeout=60) as client:
            body = {"prompt": "go", "max_tokens": 48, "ignore_eos": True}
            return await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(8)))

    try:
        responses = asyncio.run(fire())
        statuses = sorted(r.status_code for r in responses)
        assert 200 in statuses and 503 in statuses, statuses
        for r in responses:
            if r.status_code == 503:
                assert r.headers["retry-after"] == "1" and _error(r, 503)["message"]
            else:
                assert r.json()["usage"]["completion_tokens"] == 48
        _wait_idle(eng)
    finally:
        live.stop()
        asyncio.run(eng.shutdown(1.0))


def test_api_key(engine) -> None:
    cfg = ServerConfig(api_key=API_KEY)
    live = LiveServer(create_app(engine, cfg), cfg)
    try:
        with httpx.Client(base_url=live.url, timeout=30) as client:
            assert client.get("/health").status_code == 200
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
                _error(client.get("/v1/models", headers=headers), 401)
                _error(client.post("/v1/completions", json={"prompt": "x"}, headers=headers), 401)
            _error(client.get("/metrics"), 401)
            ok = client.get("/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
            assert ok.status_code == 200
        oa = openai.OpenAI(base_url=f"{live.url}/v1", api_key=API_KEY)
        assert oa.models.list().data[0].id == engine.model_name
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{live.url}/v1", api_key="wrong").models.list()
    finally:
        live.stop()


def test_openai_client(server, engine) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    name = engine.model_name
    chat = client.chat.completions.create(model=name, messages=USER_HI, max_tokens=4, temperature=0,
                                          extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert chat.choices[0].message.content and chat.usage.completion_tokens <= 4
    stream = client.chat.completions.create(model=name, messages=USER_HI, max_tokens=4, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[0].choices[0].delta.role == "assistant"
    comp = client.completions.create(model=name, prompt="Hello", max_tokens=3, temperature=0)
    assert comp.choices[0].text and comp.usage.completion_tokens <= 3
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="nope", messages=USER_HI)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=name, prompt="x", max_tokens=MAX_MODEL_LEN)


def test_health_is_503_until_engine_attached(engine) -> None:
    cfg = ServerConfig()
    app = create_app(None, cfg)
    live = LiveServer(app, cfg)
    try:
        with httpx.Client(base_url=live.url, timeout=30) as client:
            assert client.get("/health").status_code == 503
            _error(client.post("/v1/completions", json={"prompt": "x"}), 503)
            attach_engine(app, engine)
            assert client.get("/health").status_code == 200
    finally:
        live.stop()


# ---- CLI -----------------------------------------------------------------------------------------


def test_cli_bad_flags_exit_2(capsys) -> None:
    for argv in (["serve", "--bogus"], ["serve", "--port", "x"], ["serve", "--kv-cache-memory", "lots"],
                 ["serve", "--default-chat-template-kwargs", "[1]"], ["serve", "/no/such/dir"],
                 ["serve", "--chat-template", "/no/such/template.jinja"], ["serve", "--chat-template", "{% if %}"]):
        with pytest.raises(SystemExit) as exc:
            run(argv)
        assert exc.value.code == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.startswith("tandem") and "\n" not in err, err
    args = build_parser().parse_args(["serve", "m", "--no-enable-prefix-caching", "--max-num-seqs", "3"])
    assert args.enable_prefix_caching is False and args.max_num_seqs == 3


def test_cli_serves_builtin_and_exits_0_on_sigterm(tmp_path, model_dir) -> None:
    env = {**os.environ, "TANDEM_CACHE_DIR": str(model_dir.parent)}  # reuse the generated model
    proc, url = start_serve("tandem-builtin", "--kv-cache-memory", "16MiB", "--max-model-len", str(MAX_MODEL_LEN),
                            "--log-level", "warning", env=env, timeout=60)
    try:
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "tandem-builtin"
        chat = httpx.post(f"{url}/v1/chat/completions", json={"messages": USER_HI, "max_tokens": 3}, timeout=30).json()
        assert "reasoning_content" in chat["choices"][0]["message"]  # qwen3 parser on by default
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
