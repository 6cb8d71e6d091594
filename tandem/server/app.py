"""The FastAPI app: state, middleware (API key, body size, request metrics) and error handlers.

The app can exist before the engine: `tandem serve` binds the port at once so /health answers 503
while the model loads, then calls `attach_engine` when it is ready.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CollectorRegistry, Counter
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tandem.config import ServerConfig
from tandem.server import errors
from tandem.server.chat_template import ChatRenderError, ChatTemplate, ChatTemplateError, resolve_template_source
from tandem.server.errors import APIError
from tandem.server.protocol import REQUEST_BODIES, chat_template_inputs
from tandem.server.reasoning import ReasoningParser, get_reasoning_parser
from tandem.server.text_workers import TextWorkers, TokenizeError

logger = logging.getLogger("tandem.server")

OPEN_PATHS = frozenset({"/health"})  # reachable without the API key (load balancers, probes)


@dataclass
class ServerState:
    """What the routes share. `engine` is None until the model has loaded."""

    cfg: ServerConfig
    engine: Any = None
    chat_template: ChatTemplate | None = None
    chat_template_error: str | None = None
    reasoning_parser: type[ReasoningParser] | None = None
    text_workers: TextWorkers | None = None  # chat templates and tokenizer, off the event loop
    load_error: str | None = None
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    http_requests: Counter | None = None

    def ready_engine(self) -> Any:
        if self.engine is None:
            reason = self.load_error or "the model is still loading"
            raise errors.engine_unavailable(f"Service unavailable: {reason}")
        if self.engine.is_dead:
            raise errors.engine_unavailable("Service unavailable: the engine has stopped")
        return self.engine

    def model_names(self) -> tuple[str, ...]:
        """The names a request may give as `model`: the engine's model_name (the one responses
        carry) first, then the other --served-model-name names."""
        first = self.ready_engine().model_name
        return (first, *(name for name in self.cfg.served_model_names if name != first))

    def check_model(self, name: str | None) -> None:
        """503 while no engine serves, `unknown_model` for a name that is not served; no name is fine."""
        if name and name not in self.model_names():
            raise errors.unknown_model(name)

    def template(self) -> ChatTemplate:
        if self.chat_template is None:
            raise errors.bad_request(self.chat_template_error or "no chat template is loaded")
        return self.chat_template

    def _text(self) -> TextWorkers:
        """The worker processes that render and tokenize for the routes."""
        self.ready_engine()
        assert self.text_workers is not None, "attach_engine starts the text workers with the engine"
        return self.text_workers

    async def encode(self, texts: list[str], add_special_tokens: bool, param: str = "prompt") -> list[list[int]]:
        """Token ids of each text, tokenized in a worker process; untokenizable text is HTTP 400."""
        try:
            return await self._text().encode(texts, add_special_tokens)
        except TokenizeError as e:
            raise errors.bad_request(str(e), param) from e

    async def decode(self, ids: list[int], param: str = "tokens") -> str:
        """The text of token ids, decoded in a worker process."""
        try:
            return await self._text().decode(ids)
        except TokenizeError as e:
            raise errors.bad_request(str(e), param) from e

    async def render_chat(self, req: Any) -> tuple[str, list[int]]:
        """The prompt text and token ids of a chat request (chat completions and /tokenize render
        alike), from its `messages`, `tools`, `add_generation_prompt`, `continue_final_message` and
        `chat_template_kwargs`, rendered in a worker process. A template error, or a render that runs
        past --chat-template-timeout, is the client's: HTTP 400."""
        self.template()  # no template: a clear 400 before any work
        messages, tools = chat_template_inputs(req)
        try:
            return await self._text().render_chat(
                messages, tools, req.add_generation_prompt, req.continue_final_message, req.chat_template_kwargs
            )
        except ChatRenderError as e:
            raise errors.bad_request(str(e), "messages") from e

    def close(self) -> None:
        """Stop the worker processes (the server is exiting)."""
        if self.text_workers is not None:
            self.text_workers.close()


def state_of(request: Request) -> ServerState:
    return request.app.state.tandem


def attach_engine(app: FastAPI, engine: Any, chat_template: str | None = None) -> None:
    """Hand the loaded engine to the app; from now on /health is 200.

    `chat_template` is `--chat-template` (a path or inline template); None uses the tokenizer's.
    A missing template only disables /v1/chat/completions (with a clear 400); a broken one given
    on the command line raises ChatTemplateError.
    """
    state: ServerState = app.state.tandem
    tok = engine.tokenizer
    if chat_template is None:
        chat_template = _configured_chat_template(engine)
    try:
        source = resolve_template_source(chat_template, tok.chat_template)
        state.chat_template = ChatTemplate(source, tok.bos_token, tok.eos_token, state.cfg.default_chat_template_kwargs)
    except ChatTemplateError as e:
        if chat_template:
            raise
        state.chat_template_error = str(e)
        logger.warning("%s", e)
    template = state.chat_template
    state.text_workers = TextWorkers(
        tok.model_dir, template.source if template else None, tok.bos_token, tok.eos_token,
        state.cfg.default_chat_template_kwargs, num_workers=state.cfg.text_workers,
        render_timeout=state.cfg.render_timeout, max_model_len=engine.max_model_len,
    )
    state.engine = engine


def _configured_chat_template(engine: Any) -> str | None:
    """The engine config's ModelConfig.chat_template (`--chat-template`), if the engine has one."""
    model = getattr(getattr(engine, "config", None), "model", None)  # test doubles may have no config
    return getattr(model, "chat_template", None)


def mark_load_failed(app: FastAPI, reason: str) -> None:
    app.state.tandem.load_error = reason


# ---- middleware ---------------------------------------------------------------------------------


async def _send_error(send: Send, err: APIError) -> None:
    resp = err.response()
    await resp({"type": "http"}, _no_receive, send)


async def _no_receive() -> Message:  # pragma: no cover - responses never read
    return {"type": "http.disconnect"}


class ApiKeyMiddleware:
    """Every method on every path but OPEN_PATHS needs `Authorization: Bearer <key>` (OPTIONS too:
    its 404/405 answers would tell a stranger which routes exist). The comparison takes the same
    time however much of the key is right."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                await _send_error(send, errors.unauthorized())
                return
        await self.app(scope, receive, send)


class _BodyTooLarge(Exception):
    pass


class RequestSizeLimitMiddleware:
    """Refuse bodies over `limit` bytes with 413: at once from Content-Length, else while counting
    the streamed chunks (the body is never buffered past the limit). Header blocks over
    `header_limit` get 431 (h11 bounds them only while they arrive in pieces)."""

    def __init__(self, app: ASGIApp, limit: int, header_limit: int) -> None:
        self.app = app
        self.limit = limit
        self.header_limit = header_limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if sum(len(k) + len(v) + 4 for k, v in scope["headers"]) > self.header_limit:
            await _send_error(send, errors.headers_too_large(self.header_limit))
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            await _send_error(send, errors.body_too_large(self.limit))
            return
        seen = 0
        exceeded = False
        started = False

        async def counting_receive() -> Message:
            nonlocal seen, exceeded
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    exceeded = True
                    raise _BodyTooLarge()
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if exceeded and not started:  # whatever the app answered, the answer is 413
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, guarded_send)
        except _BodyTooLarge:
            pass
        if exceeded and not started:
            await _send_error(send, errors.body_too_large(self.limit))


class RequestMetricsMiddleware:
    """Counts HTTP responses by route and status (tandem:http_requests_total)."""

    def __init__(self, app: ASGIApp, counter: Counter, routes: frozenset[str]) -> None:
        self.app = app
        self.counter = counter
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if path not in self.routes:  # a model id is not a label value: the route's template is
            path = "/v1/models/{model_id}" if path.startswith("/v1/models/") else "other"

        async def recording_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.counter.labels(handler=path, status=str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, recording_send)


# ---- app ----------------------------------------------------------------------------------------


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError):
        message, param = errors.validation_message(list(exc.errors()))
        return errors.bad_request(message, param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException):
        return APIError(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None)).response()

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        return errors.internal_error(f"{request.method} {request.url.path}", exc).response()


def _install_openapi(app: FastAPI) -> None:
    """/openapi.json with the request bodies' schemas: the routes parse their bodies themselves (to
    bound the JSON first), so FastAPI cannot see the models; they are added here."""
    from fastapi.openapi.utils import get_openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for path, model in REQUEST_BODIES.items():
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
                schema["paths"][path]["post"]["requestBody"] = {
                    "required": True,
                    "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}},
                }
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # FastAPI's documented way to customise the schema


def create_app(engine: Any = None, server_cfg: ServerConfig | None = None, chat_template: str | None = None) -> FastAPI:
    """Build the app. With `engine=None` it serves /health 503 until `attach_engine` is called."""
    import tandem
    from tandem.server import routes_misc, routes_openai

    cfg = server_cfg or ServerConfig()
    app = FastAPI(title="Tandem", version=tandem.__version__, docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json")
    state = ServerState(cfg)
    if cfg.reasoning_parser:
        state.reasoning_parser = get_reasoning_parser(cfg.reasoning_parser)
    state.http_requests = Counter(
        "tandem:http_requests", "HTTP responses by route and status", ["handler", "status"], registry=state.registry
    )
    app.state.tandem = state
    app.include_router(routes_openai.router)
    app.include_router(routes_misc.router)
    _install_error_handlers(app)
    _install_openapi(app)
    routes = frozenset(r.path for router in (routes_openai.router, routes_misc.router) for r in router.routes)
    # Added last = outermost: responses are counted, then the API key is checked, then sizes.
    app.add_middleware(RequestSizeLimitMiddleware, limit=cfg.max_request_body_bytes, header_limit=cfg.max_header_bytes)
    if cfg.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=cfg.api_key)
    app.add_middleware(RequestMetricsMiddleware, counter=state.http_requests, routes=routes)
    if engine is not None:
        attach_engine(app, engine, chat_template)
    return app
