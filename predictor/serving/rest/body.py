"""The edge of every REST request with a body, before any route (ours or KServe's) sees it.

- A body past `max_bytes` is a 413, whether it declares its length or streams it.
- A JSON body is refused (400) if it holds non-finite numbers, lone surrogates or nesting past
  `max_depth`: Python's JSON parser accepts all three, and nothing downstream can use them.
  Malformed JSON is left to the route, which says why in its own shape.
- The body is parsed once, here, by orjson (faster than `json`; a parse holds the GIL on the
  event loop throughout), and our routes take the value from the scope
  (`parsed_body`) instead of parsing it again. orjson refuses what `check_plain` refuses, so only
  a body it refuses is parsed again by `json`, to say precisely why.
- The route runs as a task that is cancelled when the client disconnects, so a unary request
  (`/generate`, V2 `/infer`, OpenAI without `stream`) stops generating when nobody waits for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from typing import Any, TypeVar

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from predictor.errors import BodyTooLarge, InvalidRequest, PredictorError
from predictor.protocols.limits import check_depth, check_plain
from predictor.protocols.openai.requests import requested_model
from predictor.serving.errors import anthropic_response, openai_response, v2_response
from predictor.serving.rest.routes import is_anthropic_path, is_openai_path
from predictor.serving.served import Resolve, ServedModel, ready_model

T = TypeVar("T")

_PARSED = "predictor.parsed_body"  # scope key: the JSON value the guard parsed


def parsed_body(scope: Scope) -> tuple[bool, Any]:
    """(True, value) if the guard parsed this request's body as JSON, else (False, None)."""
    if _PARSED in scope:
        return True, scope[_PARSED]
    return False, None


async def read_json(request: Request) -> Any:
    """The body's JSON value: the guard's parse, or (a body it left alone) parsed here."""
    parsed, value = parsed_body(request.scope)
    if parsed:
        return value
    try:
        return await request.json()
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from exc


def refusal(path: str, exc: PredictorError) -> JSONResponse:
    """`{"error": ...}`, or OpenAI's (Anthropic's) error object on OpenAI's (Anthropic's) paths."""
    if is_anthropic_path(path):
        return anthropic_response(exc)
    return openai_response(exc) if is_openai_path(path) else v2_response(exc)


class BodyGuard:
    def __init__(self, app: ASGIApp, max_bytes: int, max_depth: int) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.max_depth = max_depth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        try:
            body = await self._read(scope, receive)
            if body is None:
                return  # the client left while sending
            self._check_json(scope, body)
        except PredictorError as exc:
            await refusal(path, exc)(scope, receive, send)
            return
        await self._run(scope, body, receive, send)

    async def _read(self, scope: Scope, receive: Receive) -> bytes | None:
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            raise BodyTooLarge(self._too_large(int(declared)))
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                raise BodyTooLarge(self._too_large(size))
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _too_large(self, size: int) -> str:
        return f"the request body is {size} bytes or more; the limit is {self.max_bytes} bytes"

    def _check_json(self, scope: Scope, body: bytes) -> None:
        headers = dict(scope["headers"])
        content_type = headers.get(b"content-type", b"application/json")
        if b"json" not in content_type or b"inference-header-content-length" in headers:
            return  # the binary tensor extension, or not JSON: the route decides
        if not body:
            return
        try:
            value: Any = orjson.loads(body)
        except orjson.JSONDecodeError:
            value = self._parse_leniently(body)  # raises what is wrong, if anything
            check_plain(value, self.max_depth)
            return  # json took what orjson did not (UTF-16, say): the route parses it itself
        check_depth(value, self.max_depth)  # the rest orjson has refused already
        scope[_PARSED] = value

    def _parse_leniently(self, body: bytes) -> Any:
        try:
            return json.loads(body)
        except RecursionError as exc:
            raise InvalidRequest(f"the body is nested deeper than {self.max_depth} levels") from exc
        except ValueError:
            return None  # malformed: the route answers in its own shape

    async def _run(self, scope: Scope, body: bytes, receive: Receive, send: Send) -> None:
        disconnected = asyncio.Event()
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            await disconnected.wait()
            return {"type": "http.disconnect"}

        async def watch() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    disconnected.set()
                    return

        route = asyncio.ensure_future(self.app(scope, replay, send))
        watcher = asyncio.ensure_future(watch())
        try:
            await asyncio.wait({route, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not route.done():  # the client is gone: stop the work done for it
                route.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await route
                return
            route.result()
        finally:
            watcher.cancel()
            route.cancel()
            await asyncio.gather(watcher, route, return_exceptions=True)


async def model_and_body(
    request: Request, resolve: Resolve, decode: Callable[[Any, int, str], T]
) -> tuple[ServedModel, T]:
    """A generation route's first step: the ready model the body names and the body decoded
    with that model's default max_tokens and tool-call format (`decode(body, default,
    format)`); a body naming no model is refused by `decode`, in its protocol's words."""
    body = await read_json(request)
    name = requested_model(body)
    model = ready_model(resolve, name) if name is not None else None
    limits = model.limits if model is not None else None
    parsed = decode(
        body, limits.default_max_tokens if limits else 1, limits.tool_format if limits else "hermes"
    )
    assert model is not None  # a body without a model name is refused by decode
    return model, parsed
