"""Triton's ModelConfig, ModelStatistics and RepositoryIndex RPCs, which KServe's servicer lacks.
Thin: look the model up, encode with `protocols/triton/status.py` (the REST twins are in
`serving/rest/triton_admin.py`)."""

from __future__ import annotations

import grpc

from predictor.errors import PredictorError
from predictor.pb import triton_model_pb2 as tpb
from predictor.protocols.triton import status
from predictor.serving.errors import grpc_status
from predictor.serving.served import Models, Resolve, find, selected, view


class TritonStatusServicer:
    """ModelConfig, ModelStatistics, RepositoryIndex: Triton's RPCs that KServe's servicer lacks."""

    def __init__(self, resolve: Resolve, models: Models) -> None:
        self._resolve = resolve
        self._models = models

    async def model_config(
        self, request: tpb.ModelConfigRequest, context: grpc.aio.ServicerContext
    ) -> tpb.ModelConfigResponse:
        try:
            model = find(self._resolve, request.name, request.version)
        except PredictorError as exc:
            await context.abort(*grpc_status(exc))
        return status.config_message(view(model))

    async def model_statistics(
        self, request: tpb.ModelStatisticsRequest, context: grpc.aio.ServicerContext
    ) -> tpb.ModelStatisticsResponse:
        try:
            chosen = selected(self._resolve, self._models, request.name, request.version)
        except PredictorError as exc:
            await context.abort(*grpc_status(exc))
        return status.statistics_message([view(m) for m in chosen])

    async def repository_index(
        self, request: tpb.RepositoryIndexRequest, context: grpc.aio.ServicerContext
    ) -> tpb.RepositoryIndexResponse:
        return status.index_message([view(m) for m in self._models()], request.ready)
