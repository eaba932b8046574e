"""OpenAI-compatible routes: completions, chat completions and the model list, under
`/openai/v1` (KServe's prefix) and `/v1` (what the `openai` SDK and vLLM users type).

Thin: parse with `openai_requests`, one engine request per choice, encode with
`openai_responses`. Errors before the first byte are OpenAI's `{"error": {...}}` with a status;
after it, a `data: {"error": {...}}` event ends the stream.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from predictor.protocols.openai import requests
from predictor.protocols.openai import responses
from predictor.engine.client import gather_all
from predictor.errors import (
    EngineUnavailable,
    GenerationFailed,
    InvalidRequest,
    ModelMissing,
    Overloaded,
    PredictorError,
    message_of,
    status_of,
)
from predictor.protocols.openai.requests import InvalidField, OpenAIRequest
from predictor.serving.rest.oip import (
    RETRY_AFTER_SECONDS,
    SSE_HEADERS,
    Resolve,
    ServedModel,
    read_json,
    ready_model,
)
from predictor.types import Completion, TokenEvent

PROTOCOL = "openai"
PREFIXES = ("/openai/v1", "/v1")


def error_parts(exc: BaseException) -> tuple[int, dict[str, Any], dict[str, str]]:
    """Status (from `errors.STATUS_TABLE`), OpenAI error body and headers for an error."""
    status, message = status_of(exc).http, message_of(exc)
    if isinstance(exc, InvalidRequest):
        param = exc.param if isinstance(exc, InvalidField) else None
        return status, responses.error_body(message, "invalid_request_error", param), {}
    if isinstance(exc, ModelMissing):
        body = responses.error_body(message, "invalid_request_error", "model", "model_not_found")
        return status, body, {}
    if isinstance(exc, Overloaded):
        body = responses.error_body(message, "rate_limit_error", None, "rate_limit_exceeded")
        return status, body, {"Retry-After": RETRY_AFTER_SECONDS}
    if isinstance(exc, EngineUnavailable):
        return status, responses.error_body(message, "server_error", None, "unavailable"), {}
    return status, responses.error_body(message, "server_error"), {}


def error_response(exc: BaseException) -> JSONResponse:
    status, body, headers = error_parts(exc)
    return JSONResponse(body, status_code=status, headers=headers)


def _sse(data: str) -> bytes:
    return f"data: {data}\n\n".encode()


DONE = b"data: [DONE]\n\n"


async def _first(events: AsyncIterator[TokenEvent]) -> TokenEvent:
    event = await anext(events, None)
    if event is None:
        raise GenerationFailed("the engine ended the request without an event")
    return event


async def merge(
    streams: Sequence[AsyncIterator[TokenEvent]], firsts: Sequence[TokenEvent]
) -> AsyncIterator[tuple[int, TokenEvent]]:
    """The choices' events as they come, each with its choice index, until every one ends."""
    if len(streams) == 1:
        event = firsts[0]
        while True:
            yield 0, event
            if event.final:
                return
            event = await _first(streams[0])
    queue: asyncio.Queue[tuple[int, TokenEvent | Exception]] = asyncio.Queue()

    async def pump(index: int) -> None:
        try:
            while True:
                event = await _first(streams[index])
                queue.put_nowait((index, event))
                if event.final:
                    return
        except Exception as exc:  # handed to the consumer, which raises it
            queue.put_nowait((index, exc))

    for index, event in enumerate(firsts):
        queue.put_nowait((index, event))
    tasks = [asyncio.create_task(pump(i)) for i, e in enumerate(firsts) if not e.final]
    left = len(streams)
    try:
        while left:
            index, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            yield index, item
            left -= item.final
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def close_all(streams: Sequence[AsyncIterator[TokenEvent]]) -> None:
    for events in streams:
        await events.aclose()  # type: ignore[attr-defined]


async def start_stream(model: ServedModel, request: OpenAIRequest) -> Response:
    """Wait for every choice's first event (errors before it are JSON errors), then stream."""
    try:
        streams = await model.stream_all(request.choices, PROTOCOL)  # one unit: all or none
    except PredictorError as exc:
        return error_response(exc)
    try:
        firsts = await gather_all([_first(s) for s in streams])
    except PredictorError as exc:
        await close_all(streams)
        return error_response(exc)
    except BaseException:
        await close_all(streams)
        raise
    encoder = responses.ChunkEncoder(request)

    async def body() -> AsyncIterator[bytes]:
        events = merge(streams, firsts)
        try:
            for data in encoder.opening():
                yield _sse(data)
            async for index, event in events:
                if event.error is not None:
                    yield _sse(json.dumps(responses.error_body(event.error, "server_error")))
                    return
                encoded = encoder.event(index, event)
                if encoded is not None:
                    yield _sse(encoded)
            for data in encoder.closing():
                yield _sse(data)
            yield DONE
        except PredictorError as exc:
            yield _sse(json.dumps(error_parts(exc)[1]))
        finally:  # the client left or the stream ended: free the engine rows
            await events.aclose()  # type: ignore[attr-defined]
            await close_all(streams)

    return StreamingResponse(body(), media_type="text/event-stream", headers=SSE_HEADERS)


async def answer(model: ServedModel, request: OpenAIRequest) -> Response:
    results: list[Completion] = await model.complete_all(request.choices, PROTOCOL)
    encode = responses.chat_response if request.kind == "chat" else responses.completion_response
    return Response(encode(request, results), media_type="application/json")


Decode = Callable[[Any, int], OpenAIRequest]


def build_router(resolve: Resolve, names: Callable[[], Sequence[str]]) -> APIRouter:
    """`names` lists every registered model (KServe V1's `GET /v1/models` shape)."""
    router = APIRouter()
    created = int(time.time())

    async def serve(request: Request, decode: Decode) -> Response:
        try:
            body = await read_json(request)
            name = requests.requested_model(body)
            model = ready_model(resolve, name) if name is not None else None
            parsed = decode(body, model.default_max_tokens if model is not None else 1)
            assert model is not None  # a body without a model name is refused by decode
            if parsed.stream:
                return await start_stream(model, parsed)
            return await answer(model, parsed)
        except PredictorError as exc:
            return error_response(exc)

    async def completions(request: Request) -> Response:
        return await serve(request, requests.decode_completion)

    async def chat_completions(request: Request) -> Response:
        return await serve(request, requests.decode_chat)

    async def models() -> Response:
        listed = list(names())
        served = [n for n in listed if resolve(n) is not None]
        return JSONResponse(responses.models_list(listed, served, created))

    def openapi(schema: dict[str, Any]) -> dict[str, Any]:
        return {
            "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
            "responses": {
                "200": {"description": "OK (text/event-stream with stream: true)"},
                "400": {"description": 'Bad request: {"error": {"message", "type", "param"}}'},
                "404": {"description": "Unknown model"},
                "429": {"description": "Queue full; see Retry-After"},
                "503": {"description": "Not ready or draining"},
            },
        }

    for prefix in PREFIXES:
        router.add_api_route(
            f"{prefix}/completions", completions, methods=["POST"],
            openapi_extra=openapi(requests.COMPLETION_SCHEMA),
        )  # fmt: skip
        router.add_api_route(
            f"{prefix}/chat/completions", chat_completions, methods=["POST"],
            openapi_extra=openapi(requests.CHAT_SCHEMA),
        )  # fmt: skip
        router.add_api_route(f"{prefix}/models", models, methods=["GET"])
    return router
