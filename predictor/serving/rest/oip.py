"""REST streaming surfaces: OIP `generate`, `generate_stream` (SSE) and V2 `infer_stream` (SSE).

Thin: parse with `codecs`, call the engine once, encode. An error before the first byte is a
JSON error with a status code; an error after it is an SSE event `{"error": ...}`, then the end.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from kserve import InferRequest
from kserve.protocol.rest.v2_datamodels import InferenceRequest

from predictor.protocols import v2 as codecs
from predictor.protocols import schemas as request_schemas
from predictor.protocols.triton import tensors as triton_codec
from predictor.protocols.triton import responses as triton_responses
from predictor.engine.client import EngineClient, complete
from predictor.errors import (
    EngineUnavailable,
    InvalidRequest,
    ModelMissing,
    Overloaded,
    PredictorError,
    message_of,
    status_of,
)
from predictor.serving.rest.body import parsed_body
from predictor.observability.statistics import InferenceStatistics
from predictor.types import Completion, GenerateRequest, TokenEvent

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
RETRY_AFTER_SECONDS = "1"


@runtime_checkable
class ServedModel(Protocol):
    name: str
    llm: EngineClient
    default_max_tokens: int
    ready: bool
    statistics: InferenceStatistics

    def stream(self, request: GenerateRequest, protocol: str) -> AsyncIterator[TokenEvent]: ...

    async def stream_all(
        self, requests: Sequence[GenerateRequest], protocol: str
    ) -> Sequence[AsyncIterator[TokenEvent]]: ...

    async def complete_all(
        self, requests: Sequence[GenerateRequest], protocol: str
    ) -> list[Completion]: ...


Resolve = Callable[[str], ServedModel | None]


def ready_model(resolve: Resolve, name: str) -> ServedModel:
    """The served model of that name, ready for requests; else ModelMissing / EngineUnavailable."""
    model = resolve(name)
    if model is None:
        raise ModelMissing(f"Model with name {name} does not exist.")
    if not model.ready or not model.llm.health():
        raise EngineUnavailable(f"Model with name {name} is not ready.")
    return model


def error_headers(exc: BaseException) -> dict[str, str]:
    return {"Retry-After": RETRY_AFTER_SECONDS} if isinstance(exc, Overloaded) else {}


def error_response(exc: BaseException) -> JSONResponse:
    """`{"error": ...}` with the status `errors.STATUS_TABLE` gives (server faults: 500)."""
    return JSONResponse(
        {"error": message_of(exc)}, status_code=status_of(exc).http, headers=error_headers(exc)
    )


def sse(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()


async def start_stream(
    events: AsyncIterator[TokenEvent],
    encode: Callable[[TokenEvent], dict[str, Any]],
    every_token: bool = False,
) -> Response:
    """Wait for the first event (errors before it are JSON errors), then stream as SSE."""
    try:
        first = await events.__anext__()
    except PredictorError as exc:
        await events.aclose()  # type: ignore[attr-defined]
        return error_response(exc)

    async def body() -> AsyncIterator[bytes]:
        try:
            event: TokenEvent | None = first
            while event is not None:
                if event.error is not None:
                    yield sse({"error": event.error})
                    return
                if event.text or event.final or (every_token and event.token_ids):
                    yield sse(encode(event))
                if event.final:
                    return
                event = await anext(events, None)
        except PredictorError as exc:
            yield sse({"error": str(exc)})
        finally:  # the client left or the stream ended: free the engine row
            await events.aclose()  # type: ignore[attr-defined]

    return StreamingResponse(body(), media_type="text/event-stream", headers=SSE_HEADERS)


async def whole(
    events: AsyncIterator[TokenEvent],
    as_event: Callable[[Completion], TokenEvent] | None = None,
) -> AsyncIterator[TokenEvent]:
    """A request's events as one final event holding the whole text (a non-streamed answer)."""
    completion = await complete(events)
    if as_event is not None:
        yield as_event(completion)
        return
    c = completion
    yield TokenEvent(c.request_id, c.text, (), c.finish_reason, c.usage, logprobs=c.logprobs)


async def read_json(request: Request) -> Any:
    parsed, value = parsed_body(request.scope)
    if parsed:  # BodyGuard parsed it already
        return value
    try:
        return await request.json()
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from exc


def build_router(resolve: Resolve) -> APIRouter:
    router = APIRouter()

    async def parse_generate(
        request: Request, name: str, streaming: bool
    ) -> tuple[ServedModel, GenerateRequest, bool]:
        model = ready_model(resolve, name)
        body = await read_json(request)
        req, stream = triton_codec.decode_generate_request(
            body, model.default_max_tokens, streaming
        )
        return model, req, stream

    async def generate(request: Request, model_name: str) -> Response:
        try:
            model, req, _ = await parse_generate(request, model_name, streaming=False)
            completion = await complete(model.stream(req, "rest"))
        except PredictorError as exc:
            return error_response(exc)
        return JSONResponse(codecs.generate_response(model.name, completion))

    async def generate_stream(request: Request, model_name: str) -> Response:
        try:
            model, req, stream = await parse_generate(request, model_name, streaming=True)
        except PredictorError as exc:
            return error_response(exc)
        events = model.stream(req, "rest")
        return await start_stream(
            events if stream else whole(events),
            lambda e: codecs.generate_stream_event(model.name, e),
        )

    async def infer_stream(request: Request, model_name: str) -> Response:
        try:
            model = ready_model(resolve, model_name)
            body = await read_json(request)
            try:
                v2 = InferRequest.from_inference_request(
                    InferenceRequest.model_validate(body), model_name
                )
            except Exception as exc:  # pydantic's or KServe's own validation
                raise InvalidRequest(f"not a V2 inference request: {exc}") from exc
            decoded = triton_codec.decode_infer_request(
                v2, model.default_max_tokens, streaming=True
            )
            (req, *more) = decoded.requests
            if more:
                raise InvalidRequest("infer_stream takes one text_input element")
        except PredictorError as exc:
            return error_response(exc)

        def encode(event: TokenEvent) -> dict[str, Any]:
            response = triton_responses.encode_stream_response(v2, model.name, decoded, event)
            body, _ = response.to_rest()
            assert isinstance(body, dict)
            return body

        events = model.stream(req, "rest")
        if not decoded.stream:
            events = whole(events, lambda c: triton_responses.whole_event(decoded, c))
        return await start_stream(events, encode, triton_responses.wants_every_token(decoded))

    def route(
        path: str,
        endpoint: Callable[[Request, str], Awaitable[Response]],
        schema: dict[str, Any],
        streams: bool,
    ) -> None:
        media = "text/event-stream" if streams else "application/json"
        openapi = {
            "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
            "responses": {
                "200": {"description": "OK", "content": {media: {}}},
                "400": {"description": 'Bad request: {"error": ...}'},
                "404": {"description": "Unknown model"},
                "429": {"description": "Queue full; see Retry-After"},
                "503": {"description": "Not ready or draining"},
            },
        }
        for prefix in (
            "/v2/models/{model_name}",
            "/v2/models/{model_name}/versions/{model_version}",
        ):
            router.add_api_route(
                f"{prefix}/{path}", endpoint, methods=["POST"], openapi_extra=openapi
            )

    route("generate", generate, request_schemas.GENERATE_REQUEST_SCHEMA, streams=False)
    route("generate_stream", generate_stream, request_schemas.GENERATE_REQUEST_SCHEMA, streams=True)
    route("infer_stream", infer_stream, request_schemas.INFER_REQUEST_SCHEMA, streams=True)
    return router
