"""REST streaming surfaces: OIP `generate`, `generate_stream` (SSE) and V2 `infer_stream` (SSE).

Thin: parse with `protocols`, call the engine once, encode through `serving/streaming.py`. An
error before the first byte is a JSON error with a status code; an error after it is an SSE
event `{"error": ...}`, then the end.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from kserve import InferRequest
from kserve.protocol.rest.v2_datamodels import InferenceRequest

from predictor.engine.client import Stream, complete
from predictor.errors import InvalidRequest, PredictorError
from predictor.protocols import generate as oip
from predictor.protocols import schemas
from predictor.protocols.triton import requests as v2_requests
from predictor.protocols.triton import responses as v2_responses
from predictor.serving.errors import v2_event, v2_response
from predictor.serving.rest.body import read_json
from predictor.serving.rest.routes import add_model_route, openapi_extra
from predictor.serving.served import Resolve, ServedModel, ready_model
from predictor.serving.streaming import (
    emitted,
    first_event,
    one_prompt,
    sse,
    sse_response,
    whole,
)
from predictor.types import GenerateRequest, TokenEvent

PROTOCOL = "rest"
ERROR_SHAPE = '{"error": ...}'


async def stream_sse(
    events: Stream, encode: Callable[[TokenEvent], dict[str, Any]], every_token: bool = False
) -> Response:
    """One request's events as SSE (see the module docstring)."""

    async def body(first: TokenEvent) -> AsyncIterator[bytes]:
        try:
            async for event in emitted(first, events, every_token):
                yield sse({"error": event.error} if event.error is not None else encode(event))
        except PredictorError as exc:
            yield sse(v2_event(exc))

    return await sse_response(first_event(events), body, v2_response, events.aclose)


def build_router(resolve: Resolve) -> APIRouter:
    router = APIRouter()

    async def parse_generate(
        request: Request, name: str, streaming: bool
    ) -> tuple[ServedModel, GenerateRequest, bool]:
        model = ready_model(resolve, name)
        body = await read_json(request)
        req, stream = oip.decode_generate_request(body, model.limits, streaming)
        return model, req, stream

    async def generate(request: Request, model_name: str) -> Response:
        try:
            model, req, _ = await parse_generate(request, model_name, streaming=False)
            completion = await complete(model.stream(req, PROTOCOL))
        except PredictorError as exc:
            return v2_response(exc)
        return JSONResponse(oip.generate_response(model.name, completion))

    async def generate_stream(request: Request, model_name: str) -> Response:
        try:
            model, req, stream = await parse_generate(request, model_name, streaming=True)
        except PredictorError as exc:
            return v2_response(exc)
        events = model.stream(req, PROTOCOL)
        return await stream_sse(
            events if stream else whole(events),
            lambda e: oip.generate_stream_event(model.name, e),
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
            decoded = v2_requests.decode_infer_request(v2, model.limits, streaming=True)
            req = one_prompt(decoded.requests, "infer_stream")
        except PredictorError as exc:
            return v2_response(exc)

        def encode(event: TokenEvent) -> dict[str, Any]:
            response = v2_responses.encode_stream_response(v2, model.name, decoded, event)
            body, _ = response.to_rest()
            assert isinstance(body, dict)
            return body

        events = model.stream(req, PROTOCOL)
        if not decoded.stream:
            events = whole(events, lambda c: v2_responses.whole_event(decoded, c))
        return await stream_sse(events, encode, v2_responses.wants_every_token(decoded))

    generate_doc = schemas.GENERATE_REQUEST_SCHEMA
    for path, endpoint, schema, media in (
        ("generate", generate, generate_doc, "application/json"),
        ("generate_stream", generate_stream, generate_doc, "text/event-stream"),
        ("infer_stream", infer_stream, schemas.INFER_REQUEST_SCHEMA, "text/event-stream"),
    ):
        add_model_route(router, path, endpoint, ["POST"], openapi_extra(schema, ERROR_SHAPE, media))
    return router
