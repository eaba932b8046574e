"""Triton's model configuration, statistics and repository index over REST.

`GET /v2/models/{m}[/versions/{v}]/config`, `GET /v2/models[/{m}[/versions/{v}]]/stats` and
`POST /v2/repository/index`, answered as Triton answers them (tritonclient.http reads them).
Thin: look the model up, encode with `triton_status`. The gRPC twins are in `server/grpc.py`.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from predictor.protocols.triton import status as triton_status
from predictor.errors import InvalidRequest, ModelMissing, PredictorError
from predictor.serving.rest.oip import Resolve, ServedModel, error_response, read_json

Models = Callable[[], list[ServedModel]]


def view(model: ServedModel) -> triton_status.ModelView:
    ready = model.ready and model.llm.health()
    return triton_status.ModelView(model.name, ready, model.statistics.snapshot())


def find(resolve: Resolve, name: str, version: str) -> ServedModel:
    """The served model of that name and version (any state); else ModelMissing."""
    model = resolve(name)
    if model is None:
        raise ModelMissing(f"Request for unknown model: '{name}' is not found")
    try:
        triton_status.check_version(name, version)
    except triton_status.VersionMissing as exc:
        raise ModelMissing(str(exc)) from exc
    return model


def selected(resolve: Resolve, models: Models, name: str, version: str) -> list[ServedModel]:
    """Every model for an empty name (Triton's "all models"), else the one named."""
    return [find(resolve, name, version)] if name else models()


def build_triton_router(resolve: Resolve, models: Models) -> APIRouter:
    router = APIRouter()

    async def config(model_name: str, model_version: str = "") -> Response:
        try:
            model = find(resolve, model_name, model_version)
        except PredictorError as exc:
            return error_response(exc)
        return JSONResponse(triton_status.model_config(view(model)))

    async def stats(model_name: str = "", model_version: str = "") -> Response:
        try:
            chosen = selected(resolve, models, model_name, model_version)
        except PredictorError as exc:
            return error_response(exc)
        return JSONResponse(triton_status.statistics_response([view(m) for m in chosen]))

    async def index(request: Request) -> Response:
        try:
            body = await read_json(request) if await request.body() else {}
            if not isinstance(body, dict) or not isinstance(body.get("ready", False), bool):
                raise InvalidRequest('the body must be a JSON object like {"ready": true}')
        except PredictorError as exc:
            return error_response(exc)
        views = [view(m) for m in models()]
        return JSONResponse(triton_status.repository_index(views, body.get("ready", False)))

    for prefix in ("/v2/models/{model_name}", "/v2/models/{model_name}/versions/{model_version}"):
        router.add_api_route(f"{prefix}/config", config, methods=["GET"])
        router.add_api_route(f"{prefix}/stats", stats, methods=["GET"])
    router.add_api_route("/v2/models/stats", stats, methods=["GET"])
    router.add_api_route("/v2/repository/index", index, methods=["POST"])
    return router
