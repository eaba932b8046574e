"""vLLM's `POST /reset_prefix_cache`: the engine forgets every cached prefix (after new weights,
or between benchmark runs), and a KV-events subscriber gets AllBlocksCleared. Always on here
(vLLM serves it only with VLLM_SERVER_DEV_MODE=1): it costs the clients' cache hits, nothing
else. 200 when done; 409 while a request holds cache blocks (vLLM's engine refuses then too)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import APIRouter
from starlette.responses import JSONResponse, Response


def build_router(reset: Callable[[], Awaitable[bool]]) -> APIRouter:
    router = APIRouter()

    async def reset_prefix_cache() -> Response:
        if await reset():
            return Response(status_code=200)
        return JSONResponse(
            {"error": "requests are running: the prefix cache was not reset; try again"},
            status_code=409,
        )

    router.add_api_route(
        "/reset_prefix_cache", reset_prefix_cache, methods=["POST"], include_in_schema=False
    )
    return router
