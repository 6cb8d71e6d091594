"""Bad input never takes the server down: through the real HTTP stack (uvicorn on loopback, the real
engine on the built-in tiny model), each bad request gets a 4xx with OpenAI's error JSON naming the
problem, and a normal request is answered right after it. Also the limits that keep one request
from holding the event loop (a 15 MB message, a template that loops), auth on every method, the
h11-level 431, and the gauges after a disconnect.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

# The server stack is a test dependency; a machine without it (the GPU box) skips these tests.
pytest.importorskip("fastapi")
pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from serve_proc import free_port, start_serve
from test_server import LiveServer, _error, _wait_idle, engine, model_dir  # noqa: F401 - the fixtures
from tandem.config import ServerConfig
from tandem.core import RequestOutput
from tandem.server.app import create_app
from tandem.server.errors import APIError
from tandem.server.launch import serve_until_exit

pytestmark = pytest.mark.timeout(180)

API_KEY = "sk-inputs"
# Each template branch is picked by the first message: a loop that never ends in time, a range over
# the sandbox's limit, else the plain message.
TRICK_TEMPLATE = (
    "{% if messages[0].content == 'loop' %}{% for i in range(100000) %}{% for j in range(100000) %}"
    "{% endfor %}{% endfor %}"
    "{% elif messages[0].content == 'range' %}{% for i in range(1000000) %}{% endfor %}"
    "{% else %}<|im_start|>user\n{{ messages[0].content }}<|im_end|>\n<|im_start|>assistant\n{% endif %}"
)


CFG = ServerConfig(api_key=API_KEY, max_n=4, max_prompts=8, render_timeout=2.0)


@pytest.fixture(scope="module")
def server(engine):
    app = create_app(engine, CFG)
    live = LiveServer(app, CFG)
    yield live
    live.stop()
    app.state.tandem.close()


@pytest.fixture(scope="module")
def http(server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=server.url, timeout=60, headers=headers) as client:
        yield client


@pytest.fixture(scope="module")
def trick_server(engine):
    """The same engine behind a second app whose chat template loops or over-ranges on demand, with
    a 16 MiB body limit for the 15 MB message."""
    cfg = ServerConfig(render_timeout=2.0, max_request_body_bytes=16 * 1024 * 1024)
    app = create_app(engine, cfg, chat_template=TRICK_TEMPLATE)
    live = LiveServer(app, cfg)
    yield live
    live.stop()
    app.state.tandem.close()


def _ok_completion(http: httpx.Client) -> None:
    resp = http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3, "temperature": 0})
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 3


def _raw(http: httpx.Client, path: str, body: str) -> httpx.Response:
    return http.post(path, content=body.encode("utf-8", "surrogatepass"), headers={"Content-Type": "application/json"})


C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = '"messages": [{"role": "user", "content": "hi"}]'


def _chat(extra: str) -> str:
    return "{" + MSG + ", " + extra + "}"


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


# (id, path, raw JSON body, expected status, the param the error names or None when it names none)
BAD_INPUTS = [
    # non-finite and out-of-range floats
    ("temperature NaN", C, '{"prompt": "hi", "temperature": NaN}', 400, None),
    ("temperature Infinity", C, '{"prompt": "hi", "temperature": Infinity}', 400, None),
    ("temperature 1e400", C, '{"prompt": "hi", "temperature": 1e400}', 400, None),
    ("temperature negative", C, '{"prompt": "hi", "temperature": -1}', 400, "temperature"),
    ("top_p zero", C, '{"prompt": "hi", "top_p": 0}', 400, "top_p"),
    ("repetition_penalty 1e-300", C, '{"prompt": "hi", "repetition_penalty": 1e-300}', 400, "repetition_penalty"),
    ("frequency_penalty 3", C, '{"prompt": "hi", "frequency_penalty": 3}', 400, "frequency_penalty"),
    ("min_p 2", CHAT, _chat('"min_p": 2'), 400, "min_p"),
    # integers out of what their consumer holds
    ("seed 2^64", C, f'{{"prompt": "hi", "seed": {2**64}}}', 400, "seed"),
    ("seed below -2^63", C, f'{{"prompt": "hi", "seed": {-2**63 - 1}}}', 400, "seed"),
    ("top_k 2^63", C, f'{{"prompt": "hi", "top_k": {2**63}}}', 400, "top_k"),
    ("top_k -2", C, '{"prompt": "hi", "top_k": -2}', 400, "top_k"),
    ("n huge", C, '{"prompt": "hi", "n": 1000000}', 400, "n"),
    ("n zero", CHAT, _chat('"n": 0'), 400, "n"),
    ("max_tokens huge", C, f'{{"prompt": "hi", "max_tokens": {10**15}}}', 400, "max_tokens"),
    ("max_tokens zero", C, '{"prompt": "hi", "max_tokens": 0}', 400, "max_tokens"),
    ("min_tokens negative", C, '{"prompt": "hi", "min_tokens": -1}', 400, "min_tokens"),
    ("logprobs huge", C, '{"prompt": "hi", "logprobs": 1000000000}', 400, "logprobs"),
    ("stop_token_ids outside vocab", C, '{"prompt": "hi", "stop_token_ids": [1000000000]}', 400, "stop_token_ids"),
    ("prompt id negative", C, '{"prompt": [1, -1]}', 400, "prompt"),
    ("prompt id past vocab", C, '{"prompt": [1, 99999999]}', 400, "prompt"),
    ("too many prompts", C, json.dumps({"prompt": ["a"] * 9}), 400, "prompt"),
    ("4301-digit integer", C, '{"prompt": "hi", "max_tokens": ' + "9" * 4301 + "}", 400, None),
    ("top_logprobs without logprobs", CHAT, _chat('"top_logprobs": 2'), 400, "top_logprobs"),
    # wrong types, top level and nested
    ("body not an object", C, "[1, 2]", 400, None),
    ("body not JSON", C, '{"prompt": ', 400, None),
    ("n a string", C, '{"prompt": "hi", "n": "2"}', 400, "n"),
    ("n a bool", C, '{"prompt": "hi", "n": true}', 400, "n"),
    ("temperature a string", C, '{"prompt": "hi", "temperature": "0.5"}', 400, "temperature"),
    ("prompt ids mixed", C, '{"prompt": [[1, "a"]]}', 400, "prompt"),
    ("stop a number", C, '{"prompt": "hi", "stop": 5}', 400, "stop"),
    ("messages not a list", CHAT, '{"messages": {"role": "user"}}', 400, "messages"),
    ("messages empty", CHAT, '{"messages": []}', 400, "messages"),
    ("role unknown", CHAT, '{"messages": [{"role": "robot", "content": "hi"}]}', 400, "messages"),
    ("content a number", CHAT, '{"messages": [{"role": "user", "content": 5}]}', 400, "messages"),
    ("content part without type", CHAT, '{"messages": [{"role": "user", "content": [{"text": "a"}]}]}', 400, "messages"),
    ("content part an image", CHAT,
     '{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}', 400, "messages"),
    ("tool_calls function a number", CHAT,
     '{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "tool_calls": [{"id": "1", "type": '
     '"function", "function": 5}]}]}', 400, "messages"),
    ("tool_calls name a number", CHAT,
     '{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "tool_calls": [{"id": "1", "type": '
     '"function", "function": {"name": 5, "arguments": "{}"}}]}]}', 400, "messages"),
    ("tool_calls arguments nested too deep", CHAT,
     '{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "tool_calls": [{"id": "1", "type": '
     '"function", "function": {"name": "f", "arguments": ' + json.dumps(_deep(5000)) + "}}]}]}", 400, "messages"),
    ("tools not a list", CHAT, _chat('"tools": {"type": "function"}'), 400, "tools"),
    ("tool name a number", CHAT, _chat('"tools": [{"type": "function", "function": {"name": 5}}]'), 400, "tools"),
    ("tool name with spaces", CHAT, _chat('"tools": [{"type": "function", "function": {"name": "a b"}}]'), 400, "tools"),
    ("tool without function", CHAT, _chat('"tools": [{"type": "function"}]'), 400, "tools"),
    ("tool parameters a list", CHAT,
     _chat('"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]'), 400, "tools"),
    ("tool_choice a number", CHAT, _chat('"tool_choice": 5'), 400, "tool_choice"),
    ("tool_choice unknown word", CHAT, _chat('"tool_choice": "sometimes"'), 400, "tool_choice"),
    ("response_format type unknown", CHAT, _chat('"response_format": {"type": "xml"}'), 400, "response_format"),
    ("stream_options include_usage a string", CHAT, _chat('"stream_options": {"include_usage": "yes"}'), 400,
     "stream_options"),
    ("chat_template_kwargs a list", CHAT, _chat('"chat_template_kwargs": [1]'), 400, "chat_template_kwargs"),
    # JSON past the parse-time bounds
    ("JSON 1000 deep", C, '{"prompt": "hi", "user_data": ' + _deep(1000) + "}", 400, None),
    ("JSON 100000 deep", C, '{"prompt": "hi", "user_data": ' + _deep(100000) + "}", 400, None),
    ("extra field 70 deep", CHAT, '{"messages": [{"role": "user", "content": "a", "x": ' + _deep(70) + "}]}", 400, None),
    ("lone surrogate in content", CHAT, '{"messages": [{"role": "user", "content": "a\\ud800b"}]}', 400, None),
    ("lone surrogate in prompt", C, '{"prompt": "\\udfff"}', 400, None),
    ("lone surrogate in a key", CHAT, '{"messages": [{"role": "user", "content": "a", "\\ud800": 1}]}', 400, None),
    # routes beside generation
    ("tokenize both prompt and messages", "/tokenize", '{"prompt": "a", ' + MSG + "}", 400, "prompt"),
    ("detokenize id past vocab", "/detokenize", '{"tokens": [99999999]}', 400, "tokens"),
    ("detokenize ids a string", "/detokenize", '{"tokens": "abc"}', 400, "tokens"),
]


@pytest.mark.parametrize("path,body,status,param", [case[1:] for case in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_gets_an_openai_4xx_and_the_server_keeps_serving(http, path, body, status, param) -> None:
    err = _error(_raw(http, path, body), status)
    assert err["code"] == status
    if param is not None:
        assert err["param"] == param, err
    # No internals: the message is ours, not a Python exception's repr.
    assert "Traceback" not in err["message"] and "Error(" not in err["message"], err["message"]
    _ok_completion(http)
    assert http.get("/health").status_code == 200


def test_boundary_values_are_accepted(http) -> None:
    # The largest seed, also with n=2 (the second choice's seed wraps), and the smallest.
    for seed, n in ((2**64 - 1, 2), (-(2**63), 1)):
        resp = http.post(C, json={"prompt": "hi", "max_tokens": 2, "seed": seed, "n": n})
        assert resp.status_code == 200, resp.text
        assert len(resp.json()["choices"]) == n
    resp = http.post(C, json={"prompt": "hi", "max_tokens": 2, "top_k": 2**31 - 1, "temperature": 0.5})
    assert resp.status_code == 200, resp.text
    deep_ok = {"prompt": "hi", "max_tokens": 1, "user_data": json.loads(_deep(30))}
    assert http.post(C, json=deep_ok).status_code == 200


def test_models_shows_the_served_name_not_a_path(http, engine) -> None:
    card = http.get("/v1/models").json()["data"][0]
    assert card["id"] == engine.model_name and card["root"] == engine.model_name
    assert "/" not in json.dumps(card)


def test_every_method_and_path_needs_the_key_but_health(server) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as anon:
        for method, path in (("OPTIONS", CHAT), ("OPTIONS", "/nope"), ("GET", "/nope"), ("GET", "/v1/models"),
                             ("POST", C), ("GET", "/openapi.json"), ("DELETE", "/v1/models"), ("GET", "/v1")):
            resp = anon.request(method, path)
            err = _error(resp, 401)
            assert err["type"] == "AuthenticationError", (method, path)
            assert "location" not in resp.headers  # no redirect that echoes the Host header
        wrong = anon.get("/v1/models", headers={"Authorization": f"Bearer {API_KEY}x"})
        _error(wrong, 401)
        assert anon.get("/health").status_code == 200


def test_oversized_headers_get_an_openai_431(server) -> None:
    request = (f"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: {'a' * (CFG.max_header_bytes + 1024)}\r\n\r\n")
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(request.encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431"), head
    assert b"application/json" in head
    assert json.loads(body)["error"]["code"] == 431


def test_openapi_json_describes_the_request_bodies(http) -> None:
    spec = http.get("/openapi.json").json()
    body = spec["paths"][CHAT]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/ChatCompletionRequest"}
    chat = spec["components"]["schemas"]["ChatCompletionRequest"]
    assert "messages" in chat["required"] and "tools" in chat["properties"]


def test_an_aborted_non_streaming_choice_is_an_error_not_a_200() -> None:
    from tandem.server.routes_openai import _Choice

    with pytest.raises(APIError) as info:
        _Choice().add(RequestOutput("r", [], "", True, "abort"))
    assert info.value.status == 503


# ---- the event loop only does I/O ----------------------------------------------------------------


def test_health_stays_fast_while_a_15mb_message_is_rendered_and_tokenized(trick_server) -> None:
    url = trick_server.url
    result: dict = {}
    big = {"messages": [{"role": "user", "content": "word " * 3_000_000}], "max_tokens": 1}

    def send() -> None:
        with httpx.Client(timeout=120) as client:
            result["resp"] = client.post(f"{url}{CHAT}", json=big)

    sender = threading.Thread(target=send)
    sender.start()
    worst = 0.0
    with httpx.Client(base_url=url, timeout=10) as client:
        time.sleep(0.2)
        while sender.is_alive():
            start = time.monotonic()
            assert client.get("/health").status_code == 200
            worst = max(worst, time.monotonic() - start)
            time.sleep(0.05)
    sender.join()
    assert worst < 0.5, f"/health took {worst:.2f} s while the message was processed"
    err = _error(result["resp"], 400)  # far past the tiny model's context
    assert "maximum context length" in err["message"]


def test_a_template_that_loops_is_cut_off_and_one_over_the_range_limit_is_a_400(trick_server) -> None:
    with httpx.Client(base_url=trick_server.url, timeout=60) as client:
        start = time.monotonic()
        err = _error(client.post(CHAT, json={"messages": [{"role": "user", "content": "loop"}]}), 400)
        assert time.monotonic() - start < 30
        assert "template" in err["message"]
        err = _error(client.post(CHAT, json={"messages": [{"role": "user", "content": "range"}]}), 400)
        assert "range" in err["message"] or "template" in err["message"]
        resp = client.post(CHAT, json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert resp.status_code == 200, resp.text


def test_sigterm_stops_the_server_while_a_template_loops(tmp_path: Path) -> None:
    template = tmp_path / "loop.jinja"
    template.write_text(TRICK_TEMPLATE)
    proc, url = start_serve("tandem-builtin", "--device", "cpu", "--max-model-len", "256", "--kv-cache-memory", "16MiB",
                            "--chat-template", str(template), "--chat-template-timeout", "60",
                            # the looping render holds its connection open: uvicorn waits for it
                            # --shutdown-timeout + 5 s (30 s by default) before it closes it
                            "--shutdown-timeout", "1")
    try:
        looping = threading.Thread(target=lambda: httpx.post(f"{url}{CHAT}", timeout=120,
                                                             json={"messages": [{"role": "user", "content": "loop"}]}))
        looping.daemon = True
        looping.start()
        time.sleep(1.5)  # the render is under way in a worker
        children = _children(proc.pid)
        assert children, "the text workers are child processes of the server"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    deadline = time.monotonic() + 10
    while any(map(_alive, children)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(_alive, children)), "text workers outlived the server"


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _children(pid: int) -> list[int]:
    return [int(c) for task in Path(f"/proc/{pid}/task").iterdir()
            for c in (task / "children").read_text().split()]


# ---- gauges --------------------------------------------------------------------------------------


def _gauge(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(f"tandem:{name}{{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no tandem:{name} in /metrics")


def test_gauges_read_zero_after_the_last_stream_is_dropped(http, server, engine) -> None:
    body = json.dumps({"prompt": "hi", "max_tokens": 250, "stream": True, "ignore_eos": True}).encode()
    request = (f"POST {C} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(request)
        received = b""
        while b"data:" not in received:  # streaming has begun (the headers may come in a packet of their own)
            chunk = sock.recv(65536)
            assert chunk, f"the stream ended before its first event: {received!r}"
            received += chunk
        assert engine.engine.num_unfinished == 1  # still running when the client goes
    _wait_idle(engine)
    deadline = time.monotonic() + 10
    while True:
        text = http.get("/metrics").text
        values = [_gauge(text, g) for g in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")]
        if values == [0, 0, 0] or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert values == [0, 0, 0]


# ---- a failing request fails alone -----------------------------------------------------------------


class _FlakySampler:
    """The engine's sampler, raising for any batch that holds a request with seed 4242."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __call__(self, logits, reqs):
        if any(r.params.seed == 4242 for r in reqs):
            raise RuntimeError("injected sampler failure")
        return self.inner(logits, reqs)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def test_a_request_that_makes_the_engine_raise_fails_alone(http, engine, monkeypatch) -> None:
    good = {"prompt": "hello there", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    alone = http.post(C, json=good).json()["choices"][0]["text"]
    monkeypatch.setattr(engine.engine, "sampler", _FlakySampler(engine.engine.sampler))
    results: dict[str, httpx.Response] = {}

    def send(name: str, body: dict) -> None:
        results[name] = http.post(C, json=body)

    threads = [threading.Thread(target=send, args=("bad", {"prompt": "hi", "max_tokens": 40, "seed": 4242})),
               threading.Thread(target=send, args=("good", good))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    err = _error(results["bad"], 500)
    assert "injected sampler failure" in err["message"]
    assert results["good"].status_code == 200 and results["good"].json()["choices"][0]["text"] == alone
    assert http.get("/health").status_code == 200
    _wait_idle(engine)
    _ok_completion(http)


def test_serve_exits_with_status_1_when_the_engine_cannot_go_on(model_dir, monkeypatch) -> None:
    """`tandem serve`'s own coroutine, with an engine whose every forward pass fails: the requests
    get 500s, and once the engine gives up (MAX_FAILED_STEPS in a row) the server exits with 1."""
    from tandem import cli
    from tandem.engine.async_engine import AsyncEngine
    from tandem.engine.engine import MAX_FAILED_STEPS

    real = AsyncEngine.from_config.__func__

    def broken(klass, config, **kwargs):
        engine = real(klass, config, **kwargs)

        def fail(*args, **kw):
            raise RuntimeError("injected forward failure")

        engine.engine.runner.execute = fail
        return engine

    monkeypatch.setattr(AsyncEngine, "from_config", classmethod(broken))
    port = free_port()
    args = cli.build_parser().parse_args(["serve", str(model_dir), "--port", str(port), "--device", "cpu",
                                          "--max-model-len", "256", "--kv-cache-memory", "16MiB"])
    engine_cfg, server_cfg = cli.build_configs(args, str(model_dir))
    result: dict[str, int] = {}
    serving = threading.Thread(target=lambda: result.update(status=asyncio.run(
        serve_until_exit(engine_cfg, server_cfg, False, "warning"))))
    serving.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        time.sleep(0.1)
    for _ in range(MAX_FAILED_STEPS):
        resp = httpx.post(f"{url}{C}", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert resp.status_code in (500, 503), resp.text
        assert resp.json()["error"]["code"] == resp.status_code
    serving.join(60)
    assert not serving.is_alive() and result["status"] == 1
