"""An OpenAI-compatible HTTP client for benchmarks: streams with a timestamp per chunk, counts
tokens from `usage`, turns connection/auth/model problems into one-line fatal errors and every
other failure into a failed sample (so one bad response never ends a run)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from tandem.bench.specmetrics import SpecCounts, parse_spec_metrics

DEFAULT_URL = "http://127.0.0.1:8000"


class BenchError(Exception):
    """A problem that makes the whole benchmark pointless (unreachable server, bad key, unknown
    model). The CLI prints its message as one line and exits non-zero."""


@dataclass
class StreamSample:
    """One streamed request. Times are seconds; `chunk_times` are relative to the request start and
    hold one entry per chunk that carried output (role-only chunks and the usage chunk excluded).
    `chunk_phases[i]` is what chunk i carried: "reasoning" (reasoning_content), "tool_call"
    (tool_calls) or "content" (answer text; every chunk of a text completion), a chunk with no
    output of its own (a finish_reason alone) keeping the phase before it. `tool_calls` are the
    streamed calls put together, as OpenAI's non-streaming `message.tool_calls` (plus `index`)."""

    ok: bool = False
    error: str | None = None
    status: int | None = None
    start: float = 0.0  # perf_counter() when the request was sent
    end: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    chunk_phases: list[str] = field(default_factory=list)  # parallel to chunk_times
    prompt_tokens: int | None = None  # from usage
    completion_tokens: int | None = None  # from usage
    cached_tokens: int | None = None
    text: str = ""
    reasoning: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def num_chunks(self) -> int:
        return len(self.chunk_times)

    @property
    def tokens(self) -> int:
        """Output tokens: the server's usage count, else the number of output chunks."""
        return self.completion_tokens if self.completion_tokens is not None else self.num_chunks

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] if self.chunk_times else None

    @property
    def latency(self) -> float:
        return self.end - self.start

    @property
    def decode_time(self) -> float | None:
        if len(self.chunk_times) < 2:
            return None
        return self.chunk_times[-1] - self.chunk_times[0]

    @property
    def decode_tok_s(self) -> float | None:
        """Tokens after the first one divided by the time from first to last chunk."""
        dt = self.decode_time
        if not dt or self.tokens < 2:
            return None
        return (self.tokens - 1) / dt

    @property
    def itls(self) -> list[float]:
        """Gaps between consecutive output chunks (one token each unless the server batches)."""
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(ttft=self.ttft, tokens=self.tokens, num_chunks=self.num_chunks, decode_tok_s=self.decode_tok_s)
        return d


def _error_message(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text.strip()[:300] or resp.reason_phrase
    err = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(err, dict):
        return str(err.get("message") or err.get("detail") or err)[:300]
    return str(err)[:300]


def _rejects_model(status: int, body_text: str, message: str) -> bool:
    if status == 404 and "model" in message.lower():
        return True
    return status in (400, 404, 422) and '"param":"model"' in body_text.replace(" ", "")


class BenchClient:
    """Talks to one server. Create it, `await connect()`, use it, `await aclose()`."""

    def __init__(self, url: str = DEFAULT_URL, model: str | None = None, api_key: str | None = None,
                 timeout: float = 600.0) -> None:
        self.url = url.rstrip("/")
        if self.url.endswith("/v1"):
            self.url = self.url[: -len("/v1")]
        self.model = model
        self.api_key = api_key
        self.max_model_len: int | None = None
        self.has_tokenize: bool | None = None
        self.tokens_per_word: float | None = None  # measured by usage when there is no /tokenize
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        self.http = httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(timeout, connect=10.0), limits=limits)

    async def aclose(self) -> None:
        await self.http.aclose()

    # ---- set-up --------------------------------------------------------------------------------

    async def connect(self) -> None:
        """Check the server answers, the key is accepted and the model is served; fill in the
        default model and max_model_len. Raises BenchError with a one-line reason."""
        try:
            resp = await self.http.get(f"{self.url}/v1/models")
        except httpx.HTTPError as e:
            raise BenchError(f"cannot reach the server at {self.url}: {type(e).__name__}: {e}".rstrip(": ")) from e
        if resp.status_code in (401, 403):
            raise BenchError(f"the server at {self.url} rejected the API key (HTTP {resp.status_code}: "
                             f"{_error_message(resp)}); pass --api-key or set OPENAI_API_KEY")
        if resp.status_code != 200:
            raise BenchError(f"GET {self.url}/v1/models answered HTTP {resp.status_code}: {_error_message(resp)}")
        try:
            cards = resp.json().get("data") or []
        except ValueError as e:
            raise BenchError(f"GET {self.url}/v1/models did not return JSON; is this an OpenAI-compatible server?") from e
        ids = [c.get("id") for c in cards if isinstance(c, dict)]
        if self.model is None:
            if not ids:
                raise BenchError(f"the server at {self.url} lists no models; pass --model")
            self.model = ids[0]
        elif ids and self.model not in ids:
            raise BenchError(f"the server does not serve model {self.model!r}; it serves: {', '.join(map(str, ids))}")
        card = next((c for c in cards if c.get("id") == self.model), {})
        mml = card.get("max_model_len") or card.get("context_length") or card.get("meta", {}).get("n_ctx_train")
        self.max_model_len = int(mml) if mml else None

    def cap_length(self, tokens: int, reserve: int) -> int:
        """`tokens`, lowered so that `tokens + reserve` fits the server's max_model_len."""
        if self.max_model_len is None:
            return tokens
        return max(1, min(tokens, self.max_model_len - reserve))

    # ---- tokens --------------------------------------------------------------------------------

    async def count_tokens(self, text: str, special: bool = True) -> int | None:
        """Tokens in `text` by the server's tokenizer via POST /tokenize (`special`: with the special
        tokens a prompt gets, such as BOS; off to count generated text); None where the server has
        no such endpoint (then callers estimate from usage counts)."""
        if self.has_tokenize is False:
            return None
        body = {"model": self.model, "prompt": text, **({} if special else {"add_special_tokens": False})}
        try:
            resp = await self.http.post(f"{self.url}/tokenize", json=body)
        except httpx.HTTPError:
            self.has_tokenize = False
            return None
        if resp.status_code != 200:
            self.has_tokenize = False
            return None
        body = resp.json()
        self.has_tokenize = True
        return int(body["count"]) if "count" in body else len(body.get("tokens", []))

    async def tokenize_ids(self, text: str) -> list[int] | None:
        try:
            resp = await self.http.post(f"{self.url}/tokenize", json={"model": self.model, "prompt": text,
                                                                      "add_special_tokens": False})
        except httpx.HTTPError:
            return None
        if resp.status_code != 200:
            return None
        return list(resp.json().get("tokens", []))

    async def prompt_tokens_by_usage(self, text: str) -> int | None:
        """Tokens in `text` as the server counts them, from a 1-token completion's usage."""
        s = await self.stream(text, max_tokens=1)
        return s.prompt_tokens if s.ok else None

    # ---- metrics -------------------------------------------------------------------------------

    async def spec_counters(self) -> SpecCounts | None:
        """The speculative-decoding counters on /metrics (see `tandem.bench.specmetrics`; empty when
        the page has none); None when there is no /metrics to read."""
        try:
            resp = await self.http.get(f"{self.url}/metrics")
        except httpx.HTTPError:
            return None
        if resp.status_code != 200:
            return None
        return parse_spec_metrics(resp.text)

    # ---- generation ----------------------------------------------------------------------------

    async def stream(self, prompt: str | None = None, *, messages: list[dict] | None = None, max_tokens: int = 16,
                     ignore_eos: bool = False, temperature: float = 0.0, extra: dict | None = None,
                     on_chunk: Callable[[int], object] | None = None) -> StreamSample:
        """One streaming request (chat when `messages` is given, else a text completion).
        `on_chunk(n)` is called after the n-th output chunk arrives."""
        chat = messages is not None
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if ignore_eos:
            body["ignore_eos"] = True
        body.update({"messages": messages} if chat else {"prompt": prompt})
        body.update(extra or {})
        path = "/v1/chat/completions" if chat else "/v1/completions"
        s = StreamSample(start=time.perf_counter())
        try:
            async with self.http.stream("POST", f"{self.url}{path}", json=body) as resp:
                s.status = resp.status_code
                if resp.status_code != 200:
                    await resp.aread()
                    self._raise_if_fatal(resp)
                    s.error = f"HTTP {resp.status_code}: {_error_message(resp)}"
                    return s
                async for line in resp.aiter_lines():
                    n = s.num_chunks
                    if self._read_event(line, s, chat):
                        break
                    if on_chunk is not None and s.num_chunks > n:
                        on_chunk(s.num_chunks)
        except httpx.HTTPError as e:
            s.error = f"{type(e).__name__}: {e}"
        finally:
            s.end = time.perf_counter()
        if s.error is None:
            s.ok = bool(s.chunk_times)
            if not s.ok:
                s.error = "the stream carried no output"
        return s

    def _raise_if_fatal(self, resp: httpx.Response) -> None:
        msg = _error_message(resp)
        if resp.status_code in (401, 403):
            raise BenchError(f"the server rejected the API key (HTTP {resp.status_code}: {msg}); pass --api-key")
        if _rejects_model(resp.status_code, resp.text, msg):
            raise BenchError(f"the server rejected model {self.model!r} (HTTP {resp.status_code}: {msg}); pass --model")

    def _read_event(self, line: str, s: StreamSample, chat: bool) -> bool:
        """Fold one SSE line into the sample; True at the end of the stream."""
        if not line.startswith("data:"):
            return False
        data = line[5:].strip()
        if data == "[DONE]":
            return True
        now = time.perf_counter() - s.start
        try:
            event = json.loads(data)
        except ValueError:
            s.error = f"unparseable stream event: {data[:120]}"
            return True
        if "error" in event:
            err = event["error"]
            s.error = "stream error: " + str(err.get("message", err) if isinstance(err, dict) else err)[:300]
            return True
        usage = event.get("usage")
        if usage:
            s.prompt_tokens = usage.get("prompt_tokens")
            s.completion_tokens = usage.get("completion_tokens")
            s.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        for choice in event.get("choices") or []:
            phase = "content"
            if chat:
                delta = choice.get("delta") or {}
                content = delta.get("content") or ""
                reasoning = delta.get("reasoning_content") or delta.get("reasoning") or ""
                calls = delta.get("tool_calls") or []
                if "role" in delta and not content and not reasoning and not calls:
                    continue  # the role announcement is not a token
                s.text += content
                s.reasoning += reasoning
                _add_tool_call_deltas(s.tool_calls, calls)
                if calls:
                    phase = "tool_call"
                elif reasoning:
                    phase = "reasoning"
                elif not content and s.chunk_phases:
                    phase = s.chunk_phases[-1]  # nothing of its own (a finish_reason alone)
            else:
                s.text += choice.get("text") or ""
            if choice.get("finish_reason"):
                s.finish_reason = choice["finish_reason"]
            s.chunk_times.append(now)
            s.chunk_phases.append(phase)
            break  # one timestamp per event; benchmarks send n=1
        return False


def _add_tool_call_deltas(calls: list[dict[str, Any]], deltas: list[dict[str, Any]]) -> None:
    """Fold OpenAI streaming tool-call deltas into `calls`: a call's first delta brings its id,
    type and function name (arguments possibly ""), later ones with the same `index` append to
    function.arguments. A delta without an index continues the last call unless it brings a new id."""
    for d in deltas:
        index = d.get("index")
        if index is None:
            fresh = not calls or (d.get("id") and d["id"] != calls[-1]["id"])
            index = len(calls) if fresh else calls[-1]["index"]
        call = next((c for c in calls if c["index"] == index), None)
        if call is None:
            call = {"index": index, "id": None, "type": "function", "function": {"name": "", "arguments": ""}}
            calls.append(call)
        fn = d.get("function") or {}
        call["id"] = d.get("id") or call["id"]
        call["type"] = d.get("type") or call["type"]
        call["function"]["name"] = call["function"]["name"] or fn.get("name") or ""  # sent once, in the first delta
        args = fn.get("arguments")
        call["function"]["arguments"] += args if isinstance(args, str) else json.dumps(args) if args else ""


def api_key_from_env() -> str | None:
    return os.environ.get("TANDEM_API_KEY") or os.environ.get("OPENAI_API_KEY")
