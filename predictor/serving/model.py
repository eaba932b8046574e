"""LLMPredictor: the kserve.Model that serves V2 infer through the engine.

An adapter: it parses with `codecs`, calls the engine, encodes; it maps our errors to KServe's.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import grpc
from grpc_interceptor.exceptions import GrpcException
from kserve import InferRequest, InferResponse, Model
from kserve.errors import InvalidInput

from predictor.protocols import v2 as codecs
from predictor.protocols.triton import tensors as triton_codec
from predictor.protocols.triton import responses as triton_responses
from predictor.engine.client import EngineClient, complete_all
from predictor.errors import PredictorError, message_of, status_of
from predictor.observability.metrics import Metrics, ObservedStream
from predictor.observability.statistics import InferenceStatistics
from predictor.types import Completion, GenerateRequest

log = logging.getLogger(__name__)


def to_kserve_error(exc: BaseException, from_grpc: bool) -> Exception:
    """Our errors as KServe's REST handlers and gRPC interceptor understand them.

    Over REST our errors stay ours: the server's handler answers with `errors.STATUS_TABLE`
    (429 with Retry-After, ...). Over gRPC they become the table's status code, which KServe's
    interceptor passes through as it is; server faults are INTERNAL with a short message.
    """
    if not from_grpc:
        return exc if isinstance(exc, PredictorError) else RuntimeError(message_of(exc))
    return GrpcException(message_of(exc), getattr(grpc.StatusCode, status_of(exc).grpc))


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
            completions = await self.complete_all(decoded.requests, protocol)
        except PredictorError as exc:
            raise to_kserve_error(exc, payload.from_grpc) from exc
        except Exception as exc:
            log.exception("V2 infer failed")
            raise to_kserve_error(exc, payload.from_grpc) from exc
        return triton_responses.encode_infer_response(payload, self.name, decoded, completions)

    @property
    def statistics(self) -> InferenceStatistics:
        """Triton's ModelStatistics figures, recorded with the metrics."""
        return self.metrics.statistics

    def stream(self, request: GenerateRequest, protocol: str) -> ObservedStream:
        """Token events of one request, measured; closing the iterator aborts the request.

        Raises InvalidRequest / Overloaded / EngineUnavailable before the first event.
        """
        return self.metrics.observe(self.llm.generate(request), protocol)

    async def stream_all(
        self, requests: Sequence[GenerateRequest], protocol: str
    ) -> list[ObservedStream]:
        """Several prompts as one unit (all admitted or none), each stream measured."""
        try:
            streams = await self.llm.generate_all(requests)
        except PredictorError:
            for _ in requests:
                self.metrics.requests.labels(self.name, protocol, "rejected").inc()
            raise
        return [self.metrics.observe(s, protocol) for s in streams]

    async def complete_all(
        self, requests: Sequence[GenerateRequest], protocol: str
    ) -> list[Completion]:
        """Every prompt's whole answer; the first failure cancels the others at once."""
        return await complete_all(await self.stream_all(requests, protocol))
