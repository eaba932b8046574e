"""Errors as each transport says them: one renderer per wire format, over `errors.STATUS_TABLE`.

- V2 / OIP JSON (`v2_response`): `{"error": "..."}` with the table's HTTP status (429s add
  Retry-After); used by our REST routes, the body guard, and KServe's own routes (V2 infer).
- OpenAI (`openai_response`, `openai_body`): `{"error": {"message", "type", "param", "code"}}`.
- Anthropic (`anthropic_response`, `anthropic_body`): `{"type": "error", "error": {"type",
  "message"}}` on the Messages routes.
- gRPC (`grpc_status`): the table's status code and message, for interceptors, servicers and
  ModelStreamInfer's per-request `error_message`; `kserve_error` hands ours to KServe's own code
  paths (V2 infer through `LLMPredictor.predict`).
Server faults (anything not ours) are 500 / INTERNAL with `SERVER_FAULT`; the detail is logged.

Every failed request is rendered once, by one of these: so each counts it here, by API and the
table's reason, through the one counter `count_errors` installs at start
(`predictor_request_errors_total`); admin calls (repository, config) count alike.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
from grpc_interceptor.exceptions import GrpcException
from starlette.responses import JSONResponse

from predictor.errors import (
    BodyTooLarge,
    EngineUnavailable,
    Forbidden,
    InvalidRequest,
    ModelMissing,
    Overloaded,
    PredictorError,
    message_of,
    status_of,
)
from predictor.protocols.anthropic import responses as anthropic
from predictor.protocols.openai.responses import error_body

RETRY_AFTER_SECONDS = "1"

ErrorCounter = Callable[[str, str], None]  # (api, reason)
_counter: list[ErrorCounter] = []


def count_errors(counter: ErrorCounter) -> None:
    """Count every error rendered from now on (set once, by `__main__`)."""
    _counter[:] = [counter]


def _counted(exc: BaseException, api: str) -> BaseException:
    for count in _counter:
        count(api, status_of(exc).reason)
    return exc


def headers_of(exc: BaseException) -> dict[str, str]:
    return {"Retry-After": RETRY_AFTER_SECONDS} if isinstance(exc, Overloaded) else {}


def v2_response(exc: BaseException, status: int | None = None) -> JSONResponse:
    """`{"error": ...}` with the status `errors.STATUS_TABLE` gives (server faults: 500);
    `status` overrides it (FastAPI's body validation answers 422)."""
    _counted(exc, "v2")
    return JSONResponse(
        {"error": message_of(exc)},
        status_code=status or status_of(exc).http,
        headers=headers_of(exc),
    )


def v2_event(exc: BaseException) -> dict[str, Any]:
    """The SSE event that ends a V2 / OIP stream after its first byte."""
    return {"error": message_of(_counted(exc, "v2"))}


def openai_body(exc: BaseException) -> dict[str, Any]:
    """OpenAI's error object for an error (also the event that ends a stream)."""
    message = message_of(_counted(exc, "openai"))
    if isinstance(exc, InvalidRequest):
        return error_body(message, "invalid_request_error", exc.param)
    if isinstance(exc, ModelMissing):
        return error_body(message, "invalid_request_error", "model", "model_not_found")
    if isinstance(exc, Overloaded):
        return error_body(message, "rate_limit_error", None, "rate_limit_exceeded")
    if isinstance(exc, EngineUnavailable):
        return error_body(message, "server_error", None, "unavailable")
    return error_body(message, "server_error")


def openai_response(exc: BaseException) -> JSONResponse:
    return JSONResponse(openai_body(exc), status_code=status_of(exc).http, headers=headers_of(exc))


# Anthropic's error types, by our error class (most specific first; else api_error, a 500)
_ANTHROPIC_TYPES: tuple[tuple[type[PredictorError], str], ...] = (
    (BodyTooLarge, "request_too_large"),
    (InvalidRequest, "invalid_request_error"),
    (Forbidden, "permission_error"),
    (ModelMissing, "not_found_error"),
    (Overloaded, "rate_limit_error"),
    (EngineUnavailable, "overloaded_error"),
)


def anthropic_body(exc: BaseException) -> dict[str, Any]:
    """Anthropic's error body for an error (also the `error` event that ends a stream)."""
    message = message_of(_counted(exc, "anthropic"))
    kind = next((k for cls, k in _ANTHROPIC_TYPES if isinstance(exc, cls)), "api_error")
    return anthropic.error_body(kind, message)


def anthropic_response(exc: BaseException) -> JSONResponse:
    return JSONResponse(
        anthropic_body(exc), status_code=status_of(exc).http, headers=headers_of(exc)
    )


def grpc_status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    return getattr(grpc.StatusCode, status_of(_counted(exc, "grpc")).grpc), message_of(exc)


def kserve_error(exc: BaseException, from_grpc: bool) -> Exception:
    """Our errors as KServe's REST handlers and gRPC interceptor understand them.

    Over REST our errors stay ours: the server's handler renders them with `v2_response`. Over
    gRPC they become the table's status code, which KServe's interceptor passes through as it
    is; server faults are INTERNAL with a short message.
    """
    if not from_grpc:
        return exc if isinstance(exc, PredictorError) else RuntimeError(message_of(exc))
    code, message = grpc_status(exc)
    return GrpcException(message, code)
