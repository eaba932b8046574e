"""OpenAI's Responses API route, `POST {prefix}/responses` under both OpenAI prefixes.

Thin: parse with `protocols/openai/responses_api.py` (into the same engine request a chat
completion makes), one engine request, encode with `protocols/openai/responses_output.py`.
Errors before the first byte are OpenAI's `{"error": {...}}` with a status; after it, an
`event: error` (the Responses API's error event, naming the field) ends the stream.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import Response

from predictor.engine.client import Stream, failure
from predictor.errors import PredictorError
from predictor.protocols import schemas
from predictor.protocols.limits import check_thinking
from predictor.protocols.openai.responses_api import ResponsesRequest, decode_responses
from predictor.protocols.openai.responses_output import Event, ResponseEncoder
from predictor.serving.errors import openai_body, openai_response
from predictor.serving.rest.body import model_and_body
from predictor.serving.rest.routes import OPENAI_PREFIXES, openapi_extra
from predictor.serving.served import Resolve, ServedModel
from predictor.serving.streaming import first_event, sse_response
from predictor.types import TokenEvent

PROTOCOL = "openai"  # counted with chat and completions
ERROR_SHAPE = '{"error": {"message", "type", "param"}}'


def sse_event(event: Event) -> bytes:
    """One Server-Sent Event with its name: `event: <type>` and `data: <json>`."""
    kind, data = event
    return f"event: {kind}\ndata: {data}\n\n".encode()


def error_event(exc: BaseException, sequence_number: int) -> Event:
    """The Responses API's error event (`type: error`), from OpenAI's error object."""
    error = openai_body(exc)["error"]
    body = {
        "type": "error",
        "code": error.get("code") or error.get("type"),
        "message": error["message"],
        "param": error.get("param"),
        "sequence_number": sequence_number,
    }
    return "error", json.dumps(body, ensure_ascii=False)


async def start_stream(model: ServedModel, request: ResponsesRequest) -> Response:
    """Wait for the first event (an error before it is a JSON error), then stream the events."""
    try:
        (stream,) = await model.stream_all([request.request], PROTOCOL)
    except PredictorError as exc:
        return openai_response(exc)
    encoder = ResponseEncoder(request)

    async def body(first: TokenEvent) -> AsyncIterator[bytes]:
        try:
            for event in encoder.opening():
                yield sse_event(event)
            async for token in _events(first, stream):
                if token.error is not None:
                    yield sse_event(error_event(failure(token), encoder.sequence))
                    return
                events = encoder.reasoning(token.reasoning)
                events += encoder.text(token.text, token.final)
                if token.final:
                    assert token.finish_reason is not None
                    events += encoder.closing(token.finish_reason, token.usage)
                for event in events:
                    yield sse_event(event)
        except PredictorError as exc:
            yield sse_event(error_event(exc, encoder.sequence))

    return await sse_response(first_event(stream), body, openai_response, stream.aclose)


async def _events(first: TokenEvent, stream: Stream) -> AsyncIterator[TokenEvent]:
    """`first` and the events after it, through the final one or an error."""
    event = first
    while True:
        yield event
        if event.final or event.error is not None:
            return
        event = await first_event(stream)


async def answer(model: ServedModel, request: ResponsesRequest) -> Response:
    (result,) = await model.complete_all([request.request], PROTOCOL)
    body = ResponseEncoder(request).whole(
        result.text, result.finish_reason, result.usage, result.reasoning
    )
    return Response(body, media_type="application/json")


def build_router(resolve: Resolve) -> APIRouter:
    router = APIRouter()

    async def responses(request: Request) -> Response:
        try:
            model, parsed = await model_and_body(request, resolve, decode_responses)
            check_thinking(parsed.asks_thinking, model.limits)
            if parsed.stream:
                return await start_stream(model, parsed)
            return await answer(model, parsed)
        except PredictorError as exc:
            return openai_response(exc)

    ok = "OK (text/event-stream of Responses events with stream: true)"
    for prefix in OPENAI_PREFIXES:
        router.add_api_route(
            f"{prefix}/responses",
            responses,
            methods=["POST"],
            openapi_extra=openapi_extra(schemas.RESPONSES_SCHEMA, ERROR_SHAPE, ok=ok),
        )
    return router
