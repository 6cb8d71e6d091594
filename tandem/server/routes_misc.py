"""Routes around generation: health, metrics, version, models, tokenize/detokenize."""

from __future__ import annotations

import asyncio
from typing import Any, TypeVar

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError

import tandem
from tandem.server import errors
from tandem.server.app import ServerState, state_of
from tandem.server.body import InvalidBody, parse_json_object
from tandem.server.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)

router = APIRouter()
M = TypeVar("M", bound=BaseModel)


# Bodies larger than this are parsed and validated on a worker thread, so that a 16 MiB body does
# not hold the event loop for the ~0.1 s its parse takes.
INLINE_PARSE_BYTES = 256 * 1024


async def parse_body(request: Request, model: type[M]) -> M:
    """Read and validate a JSON body; malformed JSON, JSON past the server's bounds or invalid
    fields -> HTTP 400 naming the parameter."""
    raw = await request.body()
    max_depth = state_of(request).cfg.max_json_depth
    if len(raw) <= INLINE_PARSE_BYTES:
        return _validate(raw, model, max_depth)
    return await asyncio.to_thread(_validate, raw, model, max_depth)


def _validate(raw: bytes, model: type[M], max_depth: int) -> M:
    try:
        return model.model_validate(parse_json_object(raw, max_depth))
    except InvalidBody as e:
        raise errors.bad_request(str(e)) from None
    except ValidationError as e:
        message, param = errors.validation_message(list(e.errors(include_url=False)))
        raise errors.bad_request(message, param) from None


async def parse_model_request(request: Request, model: type[M]) -> tuple[ServerState, M]:
    """The server state and the validated body of a request that names a model. In this order: a
    bad body raises the 400, an engine not serving the 503, another model's name `unknown_model`."""
    state = state_of(request)
    req = await parse_body(request, model)
    state.check_model(req.model)
    return state, req


def json_response(model: BaseModel, **dump: object) -> Response:
    return Response(model.model_dump_json(**dump), media_type="application/json")


@router.get("/health")
async def health(request: Request) -> Response:
    state = state_of(request)
    if state.engine is None or state.engine.is_dead:
        return Response(status_code=503)
    return Response(status_code=200)


@router.get("/version")
async def version() -> dict:
    return {"version": tandem.__version__}


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    state = state_of(request)
    body = generate_latest(state.registry)
    if state.engine is not None and state.engine.metrics_registry is not None:
        body = generate_latest(state.engine.metrics_registry) + body
    return Response(body, media_type=CONTENT_TYPE_LATEST)


def _model_card(name: str, engine: Any) -> ModelCard:
    # `root` is the first served name (vLLM gives the checkpoint's path, which is not the client's
    # business); every --served-model-name alias has the same root.
    return ModelCard(id=name, root=engine.model_name, max_model_len=engine.max_model_len)


@router.get("/v1/models")
async def models(request: Request) -> Response:
    state = state_of(request)
    engine = state.ready_engine()
    return json_response(ModelList(data=[_model_card(name, engine) for name in state.model_names()]))


@router.get("/v1/models/{model_id:path}")  # `path`: a served name may hold slashes (Qwen/Qwen3-30B-A3B)
async def model(request: Request, model_id: str) -> Response:
    state = state_of(request)
    engine = state.ready_engine()
    if model_id not in state.model_names():
        raise errors.model_not_found(model_id)
    return json_response(_model_card(model_id, engine))


@router.post("/tokenize")
async def tokenize(request: Request) -> Response:
    state, req = await parse_model_request(request, TokenizeRequest)
    engine = state.engine
    if (req.prompt is None) == (req.messages is None):
        raise errors.bad_request("send exactly one of `prompt` or `messages`", "prompt")
    if req.messages is not None:
        _, tokens = await state.render_chat(req)
    else:
        [tokens] = await state.encode([req.prompt], req.add_special_tokens)
    return json_response(TokenizeResponse(count=len(tokens), max_model_len=engine.max_model_len, tokens=tokens))


@router.post("/detokenize")
async def detokenize(request: Request) -> Response:
    state, req = await parse_model_request(request, DetokenizeRequest)
    tok = state.engine.tokenizer
    if any(t < 0 or t >= tok.vocab_size for t in req.tokens):
        raise errors.bad_request(f"token ids must be in [0, {tok.vocab_size})", "tokens")
    return json_response(DetokenizeResponse(prompt=await state.decode(req.tokens)))
