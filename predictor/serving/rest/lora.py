"""vLLM's run-time LoRA endpoints: `POST /v1/load_lora_adapter {lora_name, lora_path}` and
`POST /v1/unload_lora_adapter {lora_name}`, refused (403) unless --allow-runtime-lora, as vLLM
refuses them unless VLLM_ALLOW_RUNTIME_LORA_UPDATING is set."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from predictor.errors import Forbidden, InvalidRequest, PredictorError
from predictor.serving.errors import openai_response
from predictor.serving.rest.body import read_json

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,127}$")  # a model name on every route


def build_router(
    allowed: bool,
    load: Callable[[str, str], Awaitable[None]],
    unload: Callable[[str], Awaitable[None]],
) -> APIRouter:
    router = APIRouter()

    async def body_of(request: Request, keys: tuple[str, ...]) -> dict[str, str]:
        if not allowed:
            raise Forbidden(
                "loading and unloading LoRA adapters at run time is off; start the server "
                "with --allow-runtime-lora true"
            )
        body: Any = await read_json(request)
        if not isinstance(body, dict):
            raise InvalidRequest("the body must be a JSON object")
        for key in keys:
            value = body.get(key)
            if not isinstance(value, str) or not value:
                raise InvalidRequest(f"'{key}' must be a non-empty string", key)
        if not NAME.match(body["lora_name"]):
            raise InvalidRequest(
                "'lora_name' must be 1 to 128 letters, digits, '.', '_', '/' or '-'", "lora_name"
            )
        return body

    async def load_adapter(request: Request) -> Response:
        try:
            body = await body_of(request, ("lora_name", "lora_path"))
            await load(body["lora_name"], body["lora_path"])
        except PredictorError as exc:
            return openai_response(exc)
        return JSONResponse({"message": f"LoRA adapter '{body['lora_name']}' loaded"})

    async def unload_adapter(request: Request) -> Response:
        try:
            body = await body_of(request, ("lora_name",))
            await unload(body["lora_name"])
        except PredictorError as exc:
            return openai_response(exc)
        return JSONResponse({"message": f"LoRA adapter '{body['lora_name']}' unloaded"})

    router.add_api_route("/v1/load_lora_adapter", load_adapter, methods=["POST"])
    router.add_api_route("/v1/unload_lora_adapter", unload_adapter, methods=["POST"])
    return router
