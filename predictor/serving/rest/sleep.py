"""vLLM's sleep endpoints: `POST /sleep` (`?level=1` or `2`), `POST /wake_up` (`?tags=...`),
`GET /is_sleeping` -> {"is_sleeping": bool}.

vLLM serves them only with VLLM_SERVER_DEV_MODE=1. Here POST /sleep and /wake_up are refused
(403) unless --enable-sleep-mode, as --allow-runtime-lora and --model-control gate the other
routes that change the server rather than ask it something: a sleep fails no request, but
whoever reaches the port could make every request pay a reload (and, asked while requests run,
their recompute). GET /is_sleeping only reads, so it is always served (an idle sleep,
--sleep-idle-seconds, needs no endpoint). Both levels free the same (the weights and the KV
cache: a wake reads the checkpoint again, mostly from the page cache); `tags` are accepted and
the whole model wakes."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from predictor.errors import Forbidden, InvalidRequest, PredictorError
from predictor.serving.errors import openai_response

LEVELS = ("1", "2")  # vLLM's: 1 keeps the weights in host memory, 2 drops them; here both drop
TAGS = ("weights", "kv_cache")  # vLLM's parts to wake; here the whole model wakes


def build_router(
    allowed: bool,
    sleep: Callable[[], Awaitable[None]],
    wake_up: Callable[[], Awaitable[None]],
    sleeping: Callable[[], bool],
) -> APIRouter:
    router = APIRouter()

    def check_allowed() -> None:
        if not allowed:
            raise Forbidden(
                "POST /sleep and /wake_up are off; start the server with --enable-sleep-mode "
                "(--sleep-idle-seconds sleeps on idle without them)"
            )

    async def sleep_route(request: Request) -> Response:
        try:
            check_allowed()
            level = request.query_params.get("level", "1")
            if level not in LEVELS:
                raise InvalidRequest(f"level must be one of {', '.join(LEVELS)}", "level")
            await sleep()
        except PredictorError as exc:
            return openai_response(exc)
        return Response(status_code=200)

    async def wake_up_route(request: Request) -> Response:
        try:
            check_allowed()
            unknown = set(request.query_params.getlist("tags")) - set(TAGS)
            if unknown:
                raise InvalidRequest(f"tags must be among {', '.join(TAGS)}", "tags")
            await wake_up()
        except PredictorError as exc:
            return openai_response(exc)
        return Response(status_code=200)

    async def is_sleeping() -> Response:
        return JSONResponse({"is_sleeping": sleeping()})

    router.add_api_route("/sleep", sleep_route, methods=["POST"], include_in_schema=False)
    router.add_api_route("/wake_up", wake_up_route, methods=["POST"], include_in_schema=False)
    router.add_api_route("/is_sleeping", is_sleeping, methods=["GET"], include_in_schema=False)
    return router
