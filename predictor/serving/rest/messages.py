"""Anthropic's Messages routes: `/v1/messages` and `/v1/messages/count_tokens`, under both
OpenAI prefixes (`serving/rest/routes.py`), so the `anthropic` SDK and Claude's agent clients
(`ANTHROPIC_BASE_URL`) work unchanged.

Thin: parse with `protocols/anthropic`, one engine request, encode with its responses. The
`x-api-key`, `anthropic-version` and `anthropic-beta` headers are accepted and not read. Errors
before the first byte are Anthropic's `{"type": "error", "error": {...}}` with a status; after
it, an `error` event ends the stream.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from predictor.engine.client import failure
from predictor.errors import PredictorError
from predictor.protocols import schemas
from predictor.protocols.anthropic import requests, responses
from predictor.protocols.anthropic.requests import MessagesRequest
from predictor.protocols.limits import check_thinking
from predictor.serving.errors import anthropic_body, anthropic_response
from predictor.serving.rest.body import model_and_body
from predictor.serving.rest.routes import MESSAGES, OPENAI_PREFIXES, openapi_extra
from predictor.serving.served import Resolve, ServedModel
from predictor.serving.streaming import first_event, sse_event, sse_response
from predictor.types import TokenEvent

PROTOCOL = "anthropic"
ERROR_SHAPE = '{"type": "error", "error": {"type", "message"}}'


async def start_stream(model: ServedModel, request: MessagesRequest) -> Response:
    """Wait for the first event (an error before it is a JSON error), then stream events."""
    try:
        (events,) = await model.stream_all([request.request], PROTOCOL)  # refusals counted
    except PredictorError as exc:
        return anthropic_response(exc)
    encoder = responses.StreamEncoder(request)

    async def body(first: TokenEvent) -> AsyncIterator[bytes]:
        try:
            for name, data in encoder.opening(first):
                yield sse_event(name, data)
            event: TokenEvent | None = first
            while event is not None:
                if event.error is not None:
                    yield sse_event("error", anthropic_body(failure(event)))
                    return
                for name, data in encoder.event(event):
                    yield sse_event(name, data)
                event = None if event.final else await first_event(events)
        except PredictorError as exc:
            yield sse_event("error", anthropic_body(exc))

    return await sse_response(first_event(events), body, anthropic_response, events.aclose)


async def answer(model: ServedModel, request: MessagesRequest) -> Response:
    (completion,) = await model.complete_all([request.request], PROTOCOL)
    return JSONResponse(responses.message_body(request, completion))


def build_router(resolve: Resolve) -> APIRouter:
    router = APIRouter()

    def message(body: object, default_max_tokens: int, tool_format: str) -> MessagesRequest:
        return requests.decode_messages(body, default_max_tokens, tool_format=tool_format)

    def counting(body: object, default_max_tokens: int, tool_format: str) -> MessagesRequest:
        return requests.decode_messages(body, default_max_tokens, True, tool_format)

    async def messages(request: Request) -> Response:
        try:
            model, parsed = await model_and_body(request, resolve, message)
            check_thinking(parsed.asks_thinking, model.limits)
            if parsed.stream:
                return await start_stream(model, parsed)
            return await answer(model, parsed)
        except PredictorError as exc:
            return anthropic_response(exc)

    async def count_tokens(request: Request) -> Response:
        """{"input_tokens": N}: the prompt as /v1/messages would send it, tools included."""
        try:
            model, parsed = await model_and_body(request, resolve, counting)
            check_thinking(parsed.asks_thinking, model.limits)
            ids = await model.llm.tokenize(parsed.request)
            return JSONResponse(responses.count_body(len(ids)))
        except PredictorError as exc:
            return anthropic_response(exc)

    ok = "OK (text/event-stream with stream: true)"
    for prefix in OPENAI_PREFIXES:
        router.add_api_route(
            f"{prefix}{MESSAGES}",
            messages,
            methods=["POST"],
            openapi_extra=openapi_extra(schemas.MESSAGES_SCHEMA, ERROR_SHAPE, ok=ok),
        )
        router.add_api_route(
            f"{prefix}{MESSAGES}/count_tokens",
            count_tokens,
            methods=["POST"],
            openapi_extra=openapi_extra(schemas.COUNT_TOKENS_SCHEMA, ERROR_SHAPE),
        )
    return router
