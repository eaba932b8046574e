"""Triton's model configuration, statistics and repository index over REST.

`GET /v2/models/{m}[/versions/{v}]/config`, `GET /v2/models[/{m}[/versions/{v}]]/stats` and
`POST /v2/repository/index`, answered as Triton answers them (tritonclient.http reads them).
Thin: look the model up, encode with `protocols/triton/status.py`. The gRPC twins are in
`serving/rpc/triton_admin.py`.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from predictor.errors import InvalidRequest, PredictorError
from predictor.protocols.triton import status
from predictor.serving.errors import v2_response
from predictor.serving.rest.body import read_json
from predictor.serving.rest.routes import add_model_route
from predictor.serving.served import Models, Resolve, find, selected, view


def build_triton_router(resolve: Resolve, models: Models) -> APIRouter:
    router = APIRouter()

    async def config(model_name: str, model_version: str = "") -> Response:
        try:
            model = find(resolve, model_name, model_version)
        except PredictorError as exc:
            return v2_response(exc)
        return JSONResponse(status.model_config(view(model)))

    async def stats(model_name: str = "", model_version: str = "") -> Response:
        try:
            chosen = selected(resolve, models, model_name, model_version)
        except PredictorError as exc:
            return v2_response(exc)
        return JSONResponse(status.statistics_response([view(m) for m in chosen]))

    async def index(request: Request) -> Response:
        try:
            body = await read_json(request) if await request.body() else {}
            if not isinstance(body, dict) or not isinstance(body.get("ready", False), bool):
                raise InvalidRequest('the body must be a JSON object like {"ready": true}')
        except PredictorError as exc:
            return v2_response(exc)
        views = [view(m) for m in models()]
        return JSONResponse(status.repository_index(views, body.get("ready", False)))

    add_model_route(router, "config", config, ["GET"])
    add_model_route(router, "stats", stats, ["GET"])
    router.add_api_route("/v2/models/stats", stats, methods=["GET"])
    router.add_api_route("/v2/repository/index", index, methods=["POST"])
    return router
