"""OpenAI-compatible routes: completions, chat completions and the model list, under both
OpenAI prefixes (`serving/rest/routes.py`).

Thin: parse with `protocols/openai`, one engine request per choice, encode with its responses.
Errors before the first byte are OpenAI's `{"error": {...}}` with a status; after it, a
`data: {"error": {...}}` event ends the stream.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from predictor.engine.client import Stream, failure, gather_all
from predictor.errors import InvalidRequest, PredictorError
from predictor.protocols import schemas
from predictor.protocols.limits import check_thinking
from predictor.protocols.openai import requests, responses
from predictor.protocols.openai.requests import OpenAIRequest
from predictor.serving.errors import openai_body, openai_response
from predictor.serving.rest import responses_api
from predictor.serving.rest.body import model_and_body, read_json
from predictor.serving.rest.routes import OPENAI_PREFIXES, openapi_extra
from predictor.serving.served import Resolve, ServedModel, ready_model
from predictor.serving.streaming import DONE, first_event, sse, sse_response
from predictor.types import Completion, TokenEvent

PROTOCOL = "openai"
ERROR_SHAPE = '{"error": {"message", "type", "param"}}'


async def merge(
    streams: Sequence[Stream], firsts: Sequence[TokenEvent]
) -> AsyncGenerator[tuple[int, TokenEvent], None]:
    """The choices' events as they come, each with its choice index, until every one ends."""
    if len(streams) == 1:
        event = firsts[0]
        while True:
            yield 0, event
            if event.final:
                return
            event = await first_event(streams[0])
    queue: asyncio.Queue[tuple[int, TokenEvent | Exception]] = asyncio.Queue()

    async def pump(index: int) -> None:
        try:
            while True:
                event = await first_event(streams[index])
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


async def close_all(streams: Sequence[Stream]) -> None:
    for events in streams:
        await events.aclose()


async def start_stream(model: ServedModel, request: OpenAIRequest) -> Response:
    """Wait for every choice's first event (errors before it are JSON errors), then stream."""
    try:
        streams = await model.stream_all(request.choices, PROTOCOL)  # one unit: all or none
    except PredictorError as exc:
        return openai_response(exc)
    encoder = responses.ChunkEncoder(request)

    async def body(firsts: list[TokenEvent]) -> AsyncIterator[bytes]:
        events = merge(streams, firsts)
        try:
            for data in encoder.opening():
                yield sse(data)
            async for index, event in events:
                if event.error is not None:
                    yield sse(json.dumps(openai_body(failure(event))))
                    return
                encoded = encoder.event(index, event)
                if encoded is not None:
                    yield sse(encoded)
            for data in encoder.closing():
                yield sse(data)
            yield DONE
        except PredictorError as exc:
            yield sse(json.dumps(openai_body(exc)))
        finally:
            await events.aclose()

    return await sse_response(
        gather_all([first_event(s) for s in streams]),
        body,
        openai_response,
        lambda: close_all(streams),
    )


async def answer(model: ServedModel, request: OpenAIRequest) -> Response:
    results: list[Completion] = await model.complete_all(request.choices, PROTOCOL)
    encode = responses.chat_response if request.kind == "chat" else responses.completion_response
    return Response(encode(request, results), media_type="application/json")


Decode = Callable[[Any, int, str], OpenAIRequest]  # body, default max_tokens, tool format


def build_router(resolve: Resolve, names: Callable[[], Sequence[str]]) -> APIRouter:
    """`names` lists every registered model (KServe V1's `GET /v1/models` shape)."""
    router = APIRouter()
    created = int(time.time())

    async def serve(request: Request, decode: Decode) -> Response:
        try:
            model, parsed = await model_and_body(request, resolve, decode)
            check_thinking(parsed.asks_thinking, model.limits)
            if parsed.stream:
                return await start_stream(model, parsed)
            return await answer(model, parsed)
        except PredictorError as exc:
            return openai_response(exc)

    async def completions(request: Request) -> Response:
        return await serve(request, lambda body, limit, _: requests.decode_completion(body, limit))

    async def chat_completions(request: Request) -> Response:
        return await serve(request, requests.decode_chat)

    async def models() -> Response:
        listed = list(names())
        served = [n for n in listed if resolve(n) is not None]
        lineage = {n: m.lineage for n in served if (m := resolve(n)) is not None and m.lineage}
        return JSONResponse(responses.models_list(listed, served, created, lineage))

    def named_or_only(body: Any) -> ServedModel:
        """The model a /tokenize body names, or, where it names none (vLLM's serve one model
        and make `model` optional there), the one model served; 400 when that is ambiguous."""
        name = requests.requested_model(body)
        if name is None:
            served = [n for n in names() if resolve(n) is not None]
            if len(served) != 1:
                raise InvalidRequest(
                    f"'model' is required: this server serves {len(served)} models", param="model"
                )
            name = served[0]
        return ready_model(resolve, name)

    async def tokenize(request: Request) -> Response:
        """vLLM's /tokenize: {count, max_model_len, tokens[, token_strs]}."""
        try:
            body = await read_json(request)
            model = named_or_only(body)
            parsed, prompt = requests.decode_tokenize(body)
            ids = await model.llm.tokenize(prompt)
            answer: dict[str, Any] = {
                "count": len(ids),
                "tokens": ids,
                "max_model_len": getattr(model.llm, "max_prompt_tokens", None),
            }
            if parsed.return_token_strs:
                answer["token_strs"] = [await model.llm.detokenize([t]) for t in ids]
            return JSONResponse(answer)
        except PredictorError as exc:
            return openai_response(exc)

    async def detokenize(request: Request) -> Response:
        """vLLM's /detokenize: {prompt}."""
        try:
            body = await read_json(request)
            model = named_or_only(body)
            parsed = requests.decode_detokenize(body)
            return JSONResponse({"prompt": await model.llm.detokenize(parsed.tokens)})
        except PredictorError as exc:
            return openai_response(exc)

    for prefix in ("", *OPENAI_PREFIXES):  # vLLM serves them at the root
        router.add_api_route(f"{prefix}/tokenize", tokenize, methods=["POST"])
        router.add_api_route(f"{prefix}/detokenize", detokenize, methods=["POST"])

    ok = "OK (text/event-stream with stream: true)"
    for prefix in OPENAI_PREFIXES:
        router.add_api_route(
            f"{prefix}/completions",
            completions,
            methods=["POST"],
            openapi_extra=openapi_extra(schemas.COMPLETION_SCHEMA, ERROR_SHAPE, ok=ok),
        )
        router.add_api_route(
            f"{prefix}/chat/completions",
            chat_completions,
            methods=["POST"],
            openapi_extra=openapi_extra(schemas.CHAT_SCHEMA, ERROR_SHAPE, ok=ok),
        )
        router.add_api_route(f"{prefix}/models", models, methods=["GET"])
    router.include_router(responses_api.build_router(resolve))  # OpenAI's Responses API
    return router
