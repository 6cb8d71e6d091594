"""/v1/completions and /v1/chat/completions, streaming (SSE) and not."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse

from tandem.core import RequestOutput, TokenLogprobs
from tandem.engine.structured import json_schema_grammar
from tandem.server import errors
from tandem.server.app import ServerState
from tandem.server.errors import APIError
from tandem.server.generation import (
    ClientDisconnected,
    build_sampling_params,
    chat_logprobs,
    check_n,
    completion_logprobs,
    merge_streams,
    new_request_id,
    per_choice_seed,
    start_streams,
    unless_disconnected,
)
from tandem.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessageOut,
    CompletionChoice,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    PromptTokensDetails,
    UsageInfo,
)
from tandem.server.reasoning import ReasoningParser
from tandem.server.routes_misc import json_response, parse_model_request
from tandem.server.structured import ToolUse, build_grammar, check_tool_schemas, response_format_schema, tool_use
from tandem.server.tool_parsers import ToolParser, get_tool_parser

router = APIRouter()

SSE_DONE = "data: [DONE]\n\n"
CLIENT_GONE_STATUS = 499  # nginx's "client closed request": nobody reads it


@dataclass
class _Choice:
    """A choice's output accumulated from its stream deltas."""

    text: str = ""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0

    def add(self, out: RequestOutput) -> None:
        if out.finish_reason == "error":
            raise request_error(out)
        if out.finish_reason == "abort":  # ended by the server (shutdown), not by this client
            raise errors.request_aborted()
        self.text += out.new_text
        self.logprobs.extend(out.logprobs or ())
        self.num_prompt_tokens = out.num_prompt_tokens
        self.num_cached_tokens = out.num_cached_tokens
        self.num_output_tokens = out.num_output_tokens
        if out.finished:
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason


def _usage(choices: list[_Choice], n: int) -> UsageInfo:
    """Prompt tokens count once per prompt (the first of its n choices), output tokens per choice."""
    firsts = choices[::n]
    prompt = sum(c.num_prompt_tokens for c in firsts)
    completion = sum(c.num_output_tokens for c in choices)
    cached = sum(c.num_cached_tokens for c in firsts)
    return UsageInfo(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


async def _collect(streams: list[AsyncIterator[RequestOutput]]) -> list[_Choice]:
    choices = [_Choice() for _ in streams]
    async for i, out in merge_streams(streams):
        choices[i].add(out)
    return choices


def request_error(out: RequestOutput) -> APIError:
    """The error of a request the engine ended with finish_reason "error": the client's (it can
    never fit the KV cache: 400) or the engine's (it failed while running it: 500)."""
    message = out.error or "the engine could not run this request"
    return errors.request_failed(message) if out.error_kind == "internal" else errors.bad_request(message)


def _error_event(e: Exception) -> str:
    err = e if isinstance(e, APIError) else errors.internal_error("a response stream", e)
    return f"data: {json.dumps(err.to_dict())}\n\n"


def _sse(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


# ---- /v1/completions ----------------------------------------------------------------------------


async def _completion_prompts(req: CompletionRequest, state: ServerState) -> list[list[int]]:
    """The token ids of each prompt (strings tokenized off the event loop). Their ids and lengths
    are checked by the engine when the requests start."""
    prompt = req.prompt
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise errors.bad_request("prompt must not be empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        prompt = [prompt]
    limit = state.cfg.max_prompts
    if len(prompt) > limit:
        raise errors.bad_request(f"at most {limit} prompts per request (--max-prompts-per-request), got {len(prompt)}",
                                 "prompt")
    texts = [p for p in prompt if isinstance(p, str)]
    encoded = iter(await state.encode(texts, req.add_special_tokens) if texts else ())
    return [next(encoded) if isinstance(p, str) else list(p) for p in prompt]


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    state, req = await parse_model_request(request, CompletionRequest)
    engine = state.engine
    check_n(req.n, state.cfg.max_n)
    if req.echo and req.logprobs is not None:
        raise errors.bad_request("echo together with logprobs (prompt logprobs) is not supported", "echo")
    prompts = await _completion_prompts(req, state)
    params = build_sampling_params(
        req, max_tokens=req.max_tokens, logprobs=req.logprobs, defaults=engine.tokenizer.generation_defaults,
        max_logprobs=state.cfg.max_logprobs,
    )
    schema = response_format_schema(req)
    if schema is not None:
        params = dataclasses.replace(params, grammar=await _checked(state, json_schema_grammar(schema), "response_format"))
    rid = new_request_id("cmpl")
    jobs = [(f"{rid}-{p}-{k}", ids, per_choice_seed(params, k)) for p, ids in enumerate(prompts) for k in range(req.n)]
    prompt_texts = [await state.decode(ids, "prompt") if req.echo else "" for ids in prompts]
    echoes = [text for text in prompt_texts for _ in range(req.n)]
    try:
        streams = await unless_disconnected(request, start_streams(engine, jobs))
        if req.stream:
            return _sse(_completion_events(state, req, rid, streams, echoes))
        choices = await unless_disconnected(request, _collect(streams))
    except ClientDisconnected:
        return Response(status_code=CLIENT_GONE_STATUS)
    tok, num_top = engine.tokenizer, req.logprobs or 0
    resp = CompletionResponse(
        id=rid,
        model=engine.model_name,
        choices=[
            CompletionChoice(
                index=i,
                text=echoes[i] + c.text,
                logprobs=completion_logprobs(tok, c.logprobs, num_top, 0) if req.logprobs is not None else None,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
            for i, c in enumerate(choices)
        ],
        usage=_usage(choices, req.n),
    )
    return json_response(resp)


async def _completion_events(
    state: ServerState, req: CompletionRequest, rid: str, streams: list, echoes: list[str]
) -> AsyncIterator[str]:
    engine = state.engine
    choices = [_Choice() for _ in streams]
    offsets = [0] * len(streams)
    try:
        async for i, out in merge_streams(streams):
            first = not choices[i].text and not choices[i].num_output_tokens
            choices[i].add(out)
            text = (echoes[i] if first else "") + out.new_text
            lp = None
            if req.logprobs is not None and out.logprobs:
                lp = completion_logprobs(engine.tokenizer, out.logprobs, req.logprobs, offsets[i])
            offsets[i] += len(out.new_text)
            choice = CompletionChoice(
                index=i,
                text=text,
                logprobs=lp,
                finish_reason=out.finish_reason if out.finished else None,
                stop_reason=out.stop_reason if out.finished else None,
            )
            yield CompletionChunk(id=rid, model=engine.model_name, choices=[choice]).sse()
        if req.stream_options and req.stream_options.include_usage:
            yield CompletionChunk(id=rid, model=engine.model_name, choices=[], usage=_usage(choices, req.n)).sse()
    except Exception as e:  # noqa: BLE001 - the status line is sent already: report in the stream
        yield _error_event(e)
    yield SSE_DONE


# ---- /v1/chat/completions -----------------------------------------------------------------------


def _tool_parser_class(state: ServerState) -> type[ToolParser] | None:
    name = state.cfg.tool_call_parser
    return get_tool_parser(name) if name else None


async def _grammar(state: ServerState, req: ChatCompletionRequest, use: ToolUse, parsers: list,
                   tool_class: type[ToolParser] | None) -> str | None:
    """The request's structured-output grammar (None: free output), compiled once off the event
    loop to turn a bad schema into a 400 naming its field before the request starts."""
    reasoning = parsers[0] if parsers else None
    grammar, field = build_grammar(req, use, tool_class, reasoning, state.engine.tokenizer)
    if grammar is None:
        return None
    return await _checked(state, grammar, field, use)


async def _checked(state: ServerState, grammar: str, field: str, use: ToolUse | None = None) -> str:
    """`grammar`, once it compiled off the event loop; a 400 naming `field` otherwise (naming the
    tool, when one tool's schema is what fails: those are compiled only then)."""
    check = state.engine.check_grammar

    def validate() -> str | None:
        error = check(grammar)
        if error and use is not None:
            check_tool_schemas(use, check)
        return error

    error = await asyncio.to_thread(validate)
    if error:
        raise errors.bad_request(f"{field} cannot be enforced: {error}", field)
    return grammar


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    state, req = await parse_model_request(request, ChatCompletionRequest)
    engine = state.engine
    check_n(req.n, state.cfg.max_n)
    tool_class = _tool_parser_class(state)
    use = tool_use(req, tool_class, state.cfg.enable_auto_tool_choice)
    prompt, ids = await state.render_chat(req)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if req.top_logprobs is not None and not req.logprobs:
        raise errors.bad_request("top_logprobs needs logprobs to be true", "top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = build_sampling_params(
        req, max_tokens=max_tokens, logprobs=logprobs, defaults=engine.tokenizer.generation_defaults,
        max_logprobs=state.cfg.max_logprobs, logprobs_param="top_logprobs",
    )
    rid = new_request_id("chatcmpl")
    kwargs = {**state.template().default_kwargs, **(req.chat_template_kwargs or {})}
    parsers = [state.reasoning_parser(prompt, kwargs) if state.reasoning_parser else None for _ in range(req.n)]
    grammar = await _grammar(state, req, use, parsers, tool_class)
    if grammar is not None:
        params = dataclasses.replace(params, grammar=grammar)
    jobs = [(f"{rid}-{k}", ids, per_choice_seed(params, k)) for k in range(req.n)]
    tool_parsers = [tool_class(list(use.tools)) if use.parse and tool_class else None for _ in jobs]
    try:
        streams = await unless_disconnected(request, start_streams(engine, jobs))
        if req.stream:
            return _sse(_chat_events(state, req, rid, streams, parsers, tool_parsers))
        choices = await unless_disconnected(request, _collect(streams))
    except ClientDisconnected:
        return Response(status_code=CLIENT_GONE_STATUS)
    out = []
    for i, (c, parser, tool_parser) in enumerate(zip(choices, parsers, tool_parsers)):
        reasoning, content = parser.extract(c.text) if parser else (None, c.text)
        calls = []
        if tool_parser is not None and content:
            content, calls = tool_parser.extract(content)
        if content is None and reasoning is None and not calls:
            content = ""
        lp = chat_logprobs(engine.tokenizer, c.logprobs, req.top_logprobs or 0) if req.logprobs else None
        message = ChatMessageOut(content=content, reasoning_content=reasoning, reasoning=reasoning,
                                 tool_calls=[call.to_openai() for call in calls])
        finish = _finish_reason(c.finish_reason, bool(calls))
        out.append(ChatChoice(index=i, message=message, logprobs=lp, finish_reason=finish, stop_reason=c.stop_reason))
    resp = ChatCompletionResponse(id=rid, model=engine.model_name, choices=out, usage=_usage(choices, req.n))
    return json_response(resp)


def _finish_reason(reason: str | None, called: bool) -> str | None:
    """OpenAI's finish_reason: "tool_calls" when a choice that stopped by itself made calls."""
    return "tool_calls" if called and reason == "stop" else reason


def _split(parser: ReasoningParser | None, text: str, finished: bool) -> tuple[str | None, str | None]:
    if parser is None:
        return None, text or None
    reasoning, content = parser.delta(text)
    if finished:
        r2, c2 = parser.flush()
        reasoning = (reasoning or "") + (r2 or "") or None
        content = (content or "") + (c2 or "") or None
    return reasoning, content


def _tool_split(parser: ToolParser | None, content: str | None, finished: bool
                ) -> tuple[str | None, list[dict] | None]:
    """A content delta through the choice's tool-call parser: (content, tool_calls delta or None)."""
    if parser is None:
        return content, None
    parts = [parser.delta(content)] if content else []
    if finished:
        parts.append(parser.flush())
    text = "".join(p.content or "" for p in parts) or None
    calls = [d.to_openai() for p in parts for d in p.calls]
    return text, calls or None


async def _chat_events(
    state: ServerState, req: ChatCompletionRequest, rid: str, streams: list, parsers: list, tool_parsers: list
) -> AsyncIterator[str]:
    engine = state.engine
    model = engine.model_name
    choices = [_Choice() for _ in streams]
    try:
        for i in range(len(streams)):
            role = ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
            yield ChatCompletionChunk(id=rid, model=model, choices=[role]).sse()
        async for i, out in merge_streams(streams):
            choices[i].add(out)
            reasoning, content = _split(parsers[i], out.new_text, out.finished)
            content, calls = _tool_split(tool_parsers[i], content, out.finished)
            lp = None
            if req.logprobs and out.logprobs:
                lp = chat_logprobs(engine.tokenizer, out.logprobs, req.top_logprobs or 0)
            if reasoning is None and content is None and calls is None and lp is None and not out.finished:
                continue  # e.g. a tag held back by the reasoning or tool-call parser
            finish = None
            if out.finished:
                finish = _finish_reason(out.finish_reason, bool(tool_parsers[i] and tool_parsers[i].calls))
            choice = ChatChunkChoice(
                index=i,
                delta=DeltaMessage(content=content, reasoning_content=reasoning, reasoning=reasoning, tool_calls=calls),
                logprobs=lp,
                finish_reason=finish,
                stop_reason=out.stop_reason if out.finished else None,
            )
            yield ChatCompletionChunk(id=rid, model=model, choices=[choice]).sse()
        if req.stream_options and req.stream_options.include_usage:
            yield ChatCompletionChunk(id=rid, model=model, choices=[], usage=_usage(choices, req.n)).sse()
    except Exception as e:  # noqa: BLE001 - the status line is sent already: report in the stream
        yield _error_event(e)
    yield SSE_DONE
