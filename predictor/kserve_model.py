"""LLMPredictor: the kserve.Model that serves V2 infer through the engine.

An adapter: it parses with `codecs`, calls the engine, encodes; it maps our errors to KServe's.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from grpc_interceptor import exceptions as grpc_status
from kserve import InferRequest, InferResponse, Model
from kserve.errors import InferenceError, InvalidInput

from predictor import codecs, triton_codec
from predictor.engine.client import EngineClient, complete
from predictor.errors import (
    EngineUnavailable,
    InvalidRequest,
    Overloaded,
    PredictorError,
)
from predictor.metrics import Metrics
from predictor.statistics import InferenceStatistics
from predictor.types import GenerateRequest, TokenEvent


def to_kserve_error(exc: PredictorError, grpc: bool) -> Exception:
    """Our errors as KServe's REST handlers and gRPC interceptor understand them.

    Over REST, Overloaded and EngineUnavailable stay ours: the server's handler answers 429 with
    Retry-After and 503. Over gRPC they become RESOURCE_EXHAUSTED and UNAVAILABLE.
    """
    if isinstance(exc, InvalidRequest):
        return InvalidInput(str(exc))
    if isinstance(exc, Overloaded):
        return grpc_status.ResourceExhausted(str(exc)) if grpc else exc
    if isinstance(exc, EngineUnavailable):
        return grpc_status.Unavailable(str(exc)) if grpc else exc
    return InferenceError(str(exc))


class LLMPredictor(Model):
    def __init__(
        self, name: str, llm: EngineClient, default_max_tokens: int, metrics: Metrics
    ) -> None:
        super().__init__(name)
        self.llm = llm
        self.default_max_tokens = default_max_tokens
        self.metrics = metrics
        metrics.track_engine(llm.running, llm.waiting)
        self.engine = True  # KServe awaits start_engine() on the server's event loop

    def load(self) -> bool:
        # The checkpoint is loaded before the server starts (see __main__); the model is
        # ready once the engine can take requests.
        self.ready = True
        return self.ready

    async def start_engine(self) -> None:
        self.llm.start()

    def stop_engine(self) -> None:
        self.llm.stop()

    async def healthy(self) -> bool:
        return self.llm.health()

    def get_input_types(self) -> list[dict[str, Any]]:
        return [{"name": codecs.TEXT_INPUT, "datatype": "BYTES", "shape": [-1]}]

    def get_output_types(self) -> list[dict[str, Any]]:
        return [{"name": codecs.TEXT_OUTPUT, "datatype": "BYTES", "shape": [-1]}]

    async def predict(
        self,
        payload: InferRequest,
        headers: dict[str, str] | None = None,
        response_headers: dict[str, str] | None = None,
    ) -> InferResponse:
        if not isinstance(payload, InferRequest):
            raise InvalidInput("expected a V2 inference request")
        try:
            decoded = triton_codec.decode_infer_request(
                payload, self.default_max_tokens, streaming=False
            )
            protocol = "grpc" if payload.from_grpc else "rest"
            completions = await asyncio.gather(
                *(complete(self.stream(r, protocol)) for r in decoded.requests)
            )
        except PredictorError as exc:
            raise to_kserve_error(exc, payload.from_grpc) from exc
        return triton_codec.encode_infer_response(payload, self.name, decoded, list(completions))

    @property
    def statistics(self) -> InferenceStatistics:
        """Triton's ModelStatistics figures, recorded with the metrics."""
        return self.metrics.statistics

    def stream(self, request: GenerateRequest, protocol: str) -> AsyncIterator[TokenEvent]:
        """Token events of one request, measured; closing the iterator aborts the request.

        Raises InvalidRequest / Overloaded / EngineUnavailable before the first event.
        """
        return self.metrics.observe(self.llm.generate(request), protocol)
