"""vLLM's health probe, `GET /health`: KServe's LLMInferenceService (llm-d) points its liveness,
readiness and start-up probes at it on the engine's port, as `vllm serve` answers it."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.responses import JSONResponse, Response

from predictor.serving.lifecycle import PredictorDataPlane


def build_router(dataplane: PredictorDataPlane) -> APIRouter:
    router = APIRouter()

    async def health() -> Response:
        """200 with an empty body while the server is ready (not draining, every model
        loaded) and every engine live; else 503 with {"error": ...} saying which."""
        live = await dataplane.live()
        if live["status"] != "alive":
            return JSONResponse({"error": live["status"]}, status_code=503)
        if not await dataplane.ready():
            return JSONResponse({"error": "the server is not ready"}, status_code=503)
        return Response(status_code=200)

    router.add_api_route("/health", health, methods=["GET"], include_in_schema=False)
    return router
