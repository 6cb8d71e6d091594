"""Glue between HTTP requests and the engine: sampling params, context checks, starting the n
streams of a request (so errors become HTTP statuses before any byte is sent), merging them,
watching for client disconnects, and OpenAI logprob shapes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import Request

from tandem.core import MAX_LOGPROBS, ParamError, RequestOutput, SamplingParams, TokenLogprobs
from tandem.engine.async_engine import EngineDeadError, QueueFullError
from tandem.server import errors
from tandem.server.errors import APIError
from tandem.server.protocol import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob
from tandem.tokenizer import Tokenizer

T = TypeVar("T")

_SAMPLING_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
)


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class ClientDisconnected(Exception):
    """The HTTP client went away; the request's engine streams were closed (aborted)."""


def build_sampling_params(
    req: Any,
    *,
    max_tokens: int | None,
    logprobs: int | None,
    defaults: dict[str, Any],
    max_logprobs: int = MAX_LOGPROBS,
    logprobs_param: str = "logprobs",
) -> SamplingParams:
    """SamplingParams from a request; fields the request leaves out take the checkpoint's
    generation_config.json defaults, then SamplingParams' own. Invalid values -> HTTP 400.
    `logprobs` above `max_logprobs` (--max-logprobs) is refused naming `logprobs_param`, the
    request field it came from (chat's is top_logprobs)."""
    fields: dict[str, Any] = {}
    for name in _SAMPLING_FIELDS:
        value = getattr(req, name)
        if value is None:
            value = defaults.get(name)
        if value is not None:
            fields[name] = value
    stop = req.stop if isinstance(req.stop, list) else ([req.stop] if req.stop else [])
    if max_tokens is not None and max_tokens < 1:
        raise errors.bad_request(f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
    if isinstance(logprobs, int) and not isinstance(logprobs, bool) and logprobs > max_logprobs:
        raise errors.bad_request(f"{logprobs_param} must be an integer in [0, {max_logprobs}] (--max-logprobs), "
                                 f"got {logprobs}", logprobs_param)
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            seed=req.seed,
            stop=tuple(s for s in stop if s),
            stop_token_ids=tuple(req.stop_token_ids or ()),
            include_stop_str_in_output=req.include_stop_str_in_output,
            ignore_eos=req.ignore_eos,
            min_tokens=req.min_tokens,
            logprobs=logprobs,
            skip_special_tokens=req.skip_special_tokens,
            **fields,
        )
    except ParamError as e:
        raise errors.bad_request(str(e), e.param) from e
    except (TypeError, ValueError) as e:
        raise errors.bad_request(str(e)) from e


def per_choice_seed(params: SamplingParams, k: int) -> SamplingParams:
    """The k-th of n choices: with a seed, each choice gets its own (seed + k), so n seeded samples
    differ from each other yet repeat across identical requests."""
    if params.seed is None or k == 0:
        return params
    return dataclasses.replace(params, seed=params.seed + k)


def check_n(n: int, max_n: int) -> None:
    if not 1 <= n <= max_n:
        raise errors.bad_request(f"n must be between 1 and {max_n} (the server's limit), got {n}", "n")


def engine_error(e: Exception) -> APIError:
    """Map what engine.generate raises to an HTTP error."""
    if isinstance(e, ParamError):
        return errors.bad_request(str(e), e.param)
    if isinstance(e, QueueFullError):
        return errors.queue_full()
    if isinstance(e, EngineDeadError):
        return errors.engine_unavailable(str(e))
    return errors.internal_error("starting a request", e)


# ---- streams ------------------------------------------------------------------------------------


async def _chain(first: RequestOutput | None, rest: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    try:
        if first is not None:
            yield first
            if first.finished:
                return
        async for out in rest:
            yield out
    finally:
        await rest.aclose()  # aborts the request in the engine if it had not finished


async def start_streams(engine: Any, jobs: list[tuple[str, list[int], SamplingParams]]) -> list[AsyncIterator[RequestOutput]]:
    """Start every (request_id, prompt ids, params) job and wait for each one's first output, so
    that a refused request (queue full, context too long, dead engine) becomes an HTTP error
    before the response starts. On any failure the others are aborted."""
    gens = [engine.generate(rid, ids, params) for rid, ids, params in jobs]

    async def first(gen: AsyncIterator[RequestOutput]) -> RequestOutput | None:
        try:
            return await gen.__anext__()
        except StopAsyncIteration:
            return None

    results = await asyncio.gather(*(first(g) for g in gens), return_exceptions=True)
    failure = next((r for r in results if isinstance(r, BaseException)), None)
    if failure is not None:
        await asyncio.gather(*(g.aclose() for g in gens), return_exceptions=True)
        if isinstance(failure, Exception):
            raise engine_error(failure) from failure
        raise failure
    return [_chain(r, g) for r, g in zip(results, gens)]


async def merge_streams(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several streams as (stream index, output). Closing the merged iterator closes
    (aborts) every stream."""
    if len(streams) == 1:
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
            queue.put_nowait((i, None))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, e))
        finally:
            await stream.aclose()

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client disconnects (call after the body was read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Run `work`, cancelling it (and so aborting its engine requests) if the client goes away."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.create_task(wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()


# ---- logprobs -----------------------------------------------------------------------------------


def _token_text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def chat_logprobs(tokenizer: Tokenizer, entries: list[TokenLogprobs], num_top: int) -> ChatLogprobs:
    content = []
    for entry in entries:
        text = _token_text(tokenizer, entry.chosen.token_id)
        tops = []
        for lp in entry.top[:num_top]:
            t = _token_text(tokenizer, lp.token_id)
            tops.append(TopLogprob(token=t, logprob=lp.logprob, bytes=list(t.encode("utf-8"))))
        content.append(
            ChatTokenLogprob(token=text, logprob=entry.chosen.logprob, bytes=list(text.encode("utf-8")), top_logprobs=tops)
        )
    return ChatLogprobs(content=content)


def completion_logprobs(
    tokenizer: Tokenizer, entries: list[TokenLogprobs], num_top: int, text_offset: int
) -> CompletionLogprobs:
    """Completions logprobs; `text_offset` is where the first token starts in the choice's text."""
    out = CompletionLogprobs()
    for entry in entries:
        text = _token_text(tokenizer, entry.chosen.token_id)
        out.tokens.append(text)
        out.token_logprobs.append(entry.chosen.logprob)
        top: dict[str, float] = {}
        for lp in entry.top[:num_top]:
            top.setdefault(_token_text(tokenizer, lp.token_id), lp.logprob)
        out.top_logprobs.append(top if num_top > 0 else None)
        out.text_offset.append(text_offset)
        text_offset += len(text)
    return out
