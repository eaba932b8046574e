"""Where our REST routes live and how the OpenAPI document describes them: the route prefixes
and the answers every route may give, in one place."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter

# a model's routes, with and without a version (we serve one version: Triton's "1")
MODEL_PREFIXES = ("/v2/models/{model_name}", "/v2/models/{model_name}/versions/{model_version}")
# OpenAI's routes: KServe's prefix and what the `openai` SDK and vLLM users type
OPENAI_PREFIXES = ("/openai/v1", "/v1")
# Anthropic's Messages routes, under the same prefixes (ANTHROPIC_BASE_URL is the host, or the
# host and /openai: the SDK adds /v1/messages)
MESSAGES = "/messages"


def is_anthropic_path(path: str) -> bool:
    return any(
        path == prefix + MESSAGES or path.startswith(prefix + MESSAGES + "/")
        for prefix in OPENAI_PREFIXES
    )


def is_openai_path(path: str) -> bool:
    """OpenAI's routes (Anthropic's Messages, under the same prefixes, are not)."""
    return not is_anthropic_path(path) and any(
        path.startswith(prefix + "/") for prefix in OPENAI_PREFIXES
    )


def openapi_extra(
    schema: dict[str, Any], error_shape: str, media: str | None = None, ok: str = "OK"
) -> dict[str, Any]:
    """The request body's schema and the answers a POST route may give (`media`: the 200's)."""
    success: dict[str, Any] = {"description": ok}
    if media is not None:
        success["content"] = {media: {}}
    return {
        "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
        "responses": {
            "200": success,
            "400": {"description": f"Bad request: {error_shape}"},
            "404": {"description": "Unknown model"},
            "429": {"description": "Queue full; see Retry-After"},
            "503": {"description": "Not ready or draining"},
        },
    }


def add_model_route(
    router: APIRouter,
    path: str,
    endpoint: Callable[..., Any],
    methods: list[str],
    openapi: dict[str, Any] | None = None,
) -> None:
    """`endpoint` under every model prefix (`{prefix}/{path}`)."""
    for prefix in MODEL_PREFIXES:
        router.add_api_route(f"{prefix}/{path}", endpoint, methods=methods, openapi_extra=openapi)
