"""BodyGuard in front of a bare ASGI route: the body is parsed once, and what it refuses."""

from __future__ import annotations

import json
from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import Receive, Scope, Send

from predictor.serving.rest.body import BodyGuard, parsed_body, read_json


async def route(scope: Scope, receive: Receive, send: Send) -> None:
    """Says whether the guard handed it a parsed body, and what read_json returns."""
    parsed, _ = parsed_body(scope)
    try:
        value: Any = await read_json(Request(scope, receive))
    except Exception as exc:  # the route's own answer to malformed JSON
        value = f"refused: {exc}"
    await JSONResponse({"parsed_by_guard": parsed, "value": value})(scope, receive, send)


async def post(content: bytes, content_type: str = "application/json") -> httpx.Response:
    app = BodyGuard(route, max_bytes=1 << 20, max_depth=8)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://guard") as client:
        return await client.post("/x", content=content, headers={"Content-Type": content_type})


async def test_a_good_body_is_parsed_once_and_handed_to_the_route() -> None:
    r = await post(json.dumps({"text_input": "caf\u00e9", "n": [1, 2.5]}).encode())
    assert r.json() == {
        "parsed_by_guard": True,
        "value": {"text_input": "caf\u00e9", "n": [1, 2.5]},
    }


async def test_refusals_name_what_is_wrong() -> None:
    for body, words in [
        (b'{"a": NaN}', "non-finite"),
        (b'{"a": 1e999}', "non-finite"),
        (b'{"a": "\\ud800"}', "surrogate"),
        (b'{"a": ' + b"[" * 20 + b"]" * 20 + b"}", "deeper than 8"),
    ]:
        r = await post(body)
        assert r.status_code == 400 and words in r.json()["error"], (body, r.text)


async def test_what_the_guard_cannot_parse_is_left_to_the_route() -> None:
    r = await post(b'{"a": ')  # malformed: the route answers in its own shape
    assert r.json()["parsed_by_guard"] is False and r.json()["value"].startswith("refused")
    utf16 = json.dumps({"a": 1}).encode("utf-16")  # json reads it, orjson does not
    r = await post(utf16)
    assert r.json() == {"parsed_by_guard": False, "value": {"a": 1}}
