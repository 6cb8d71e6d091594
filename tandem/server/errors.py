"""OpenAI-style error responses: `{"error": {"message", "type", "param", "code"}}`.

Route code raises `APIError` (or one of the helpers below); the app's exception handlers turn it,
FastAPI's validation errors and the engine's `ParamError` into this JSON with the right status.
"""

from __future__ import annotations

import logging
import uuid
from http import HTTPStatus

from fastapi.responses import JSONResponse

logger = logging.getLogger("tandem.server")

# The issue asks for 400 on an unknown model name (vLLM answers 404 NotFoundError); one constant so
# it is a one-line change if that ever needs to follow vLLM instead.
UNKNOWN_MODEL_STATUS = HTTPStatus.BAD_REQUEST
QUEUE_FULL_RETRY_AFTER_S = 1

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    413: "RequestEntityTooLargeError",
    431: "RequestHeaderFieldsTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """An error to send to the client as OpenAI error JSON."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        err_type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = int(status)
        self.message = message
        self.param = param
        self.err_type = err_type or _TYPES.get(self.status, "APIError")
        self.headers = headers

    def to_dict(self) -> dict:
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param, "code": self.status}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.to_dict(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(HTTPStatus.BAD_REQUEST, message, param)


def unknown_model(name: str) -> APIError:
    return APIError(UNKNOWN_MODEL_STATUS, f"The model `{name}` does not exist.", "model", "NotFoundError")


def model_not_found(name: str) -> APIError:
    """GET /v1/models/{name} of a name that is not served: 404, as OpenAI and vLLM answer a missing
    resource (a request *naming* an unknown model is `unknown_model`)."""
    return APIError(HTTPStatus.NOT_FOUND, f"The model `{name}` does not exist.", "model", "NotFoundError")


def unauthorized() -> APIError:
    return APIError(HTTPStatus.UNAUTHORIZED, "Unauthorized: send `Authorization: Bearer <api key>`")


def body_too_large(limit: int) -> APIError:
    return APIError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"Request body exceeds the limit of {limit} bytes")


def headers_too_large(limit: int) -> APIError:
    return APIError(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, f"Request headers exceed the limit of {limit} bytes")


def queue_full() -> APIError:
    return APIError(
        HTTPStatus.SERVICE_UNAVAILABLE,
        "The server is at its limit of queued requests (--max-queued-requests); retry later",
        headers={"Retry-After": str(QUEUE_FULL_RETRY_AFTER_S)},
    )


def engine_unavailable(reason: str) -> APIError:
    return APIError(HTTPStatus.SERVICE_UNAVAILABLE, reason)


def internal_error(where: str, exc: BaseException) -> APIError:
    """A bug or an unexpected failure: the traceback goes to the log under an error id, the client
    gets the id and no internals."""
    error_id = uuid.uuid4().hex[:12]
    logger.error("Internal error %s in %s", error_id, where, exc_info=exc)
    return APIError(HTTPStatus.INTERNAL_SERVER_ERROR, f"Internal server error (logged as {error_id})")


def request_failed(message: str) -> APIError:
    """The engine failed while running this request (other requests go on)."""
    return APIError(HTTPStatus.INTERNAL_SERVER_ERROR, message)


def request_aborted() -> APIError:
    """A non-streaming request the server ended before it finished (shutdown)."""
    return APIError(HTTPStatus.SERVICE_UNAVAILABLE, "The request was aborted: the server is shutting down; retry it",
                    headers={"Retry-After": str(QUEUE_FULL_RETRY_AFTER_S)})


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """Condense pydantic/FastAPI validation errors into one message and the first bad parameter."""
    parts, param = [], None
    for err in errors:
        loc = [str(p) for p in err.get("loc", ()) if p not in ("body",)]
        where = ".".join(loc)
        if param is None and loc:
            param = loc[0]
        parts.append(f"{where}: {err.get('msg', 'invalid')}" if where else str(err.get("msg", "invalid")))
    return "; ".join(parts) or "Invalid request", param
