"""Routes around generation: health, metrics, version, models, tokenize/detokenize."""

from __future__ import annotations

import json
from typing import TypeVar

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError

import tandem
from tandem.server import errors
from tandem.server.app import ServerState, state_of
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


async def parse_body(request: Request, model: type[M]) -> M:
    """Read and validate a JSON body; malformed JSON or invalid fields -> HTTP 400."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise errors.bad_request(f"The request body is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise errors.bad_request("The request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        message, param = errors.validation_message(list(e.errors(include_url=False)))
        raise errors.bad_request(message, param) from e


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


@router.get("/v1/models")
async def models(request: Request) -> Response:
    engine = state_of(request).ready_engine()
    root = str(getattr(engine.tokenizer, "model_dir", "")) or None
    card = ModelCard(id=engine.model_name, root=root, max_model_len=engine.max_model_len)
    return json_response(ModelList(data=[card]))


@router.post("/tokenize")
async def tokenize(request: Request) -> Response:
    state, req = await parse_model_request(request, TokenizeRequest)
    engine = state.engine
    if (req.prompt is None) == (req.messages is None):
        raise errors.bad_request("send exactly one of `prompt` or `messages`", "prompt")
    if req.messages is not None:
        tokens = engine.tokenizer.encode(state.render_chat(req), add_special_tokens=False)
    else:
        tokens = engine.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    return json_response(TokenizeResponse(count=len(tokens), max_model_len=engine.max_model_len, tokens=tokens))


@router.post("/detokenize")
async def detokenize(request: Request) -> Response:
    state, req = await parse_model_request(request, DetokenizeRequest)
    tok = state.engine.tokenizer
    if any(t < 0 or t >= tok.vocab_size for t in req.tokens):
        raise errors.bad_request(f"token ids must be in [0, {tok.vocab_size})", "tokens")
    return json_response(DetokenizeResponse(prompt=tok.decode(req.tokens)))
