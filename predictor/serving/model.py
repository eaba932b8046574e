"""LLMPredictor: the kserve.Model that serves V2 infer through the engine.

An adapter: it parses with `protocols`, calls the engine, encodes; `serving/errors.py` maps our
errors to KServe's.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from kserve import InferRequest, InferResponse, Model
from kserve.errors import InvalidInput

from predictor.engine.client import AdapterAdmin, AdapterClient, EngineClient, complete_all
from predictor.errors import PredictorError
from predictor.observability.observer import ObservedStream, Observer
from predictor.observability.statistics import InferenceStatistics
from predictor.protocols.limits import Limits
from predictor.protocols.triton import requests as v2_requests
from predictor.protocols.triton import responses as v2_responses
from predictor.protocols.triton.tensors import INPUTS, OUTPUTS, TensorSpec
from predictor.serving.errors import kserve_error
from predictor.types import Completion, GenerateRequest

log = logging.getLogger(__name__)


class LLMPredictor(Model):
    # a LoRA adapter's (base model, path it was loaded from): vLLM's `parent` and `root`
    lineage: tuple[str, str] | None = None

    def __init__(
        self,
        name: str,
        llm: EngineClient,
        limits: Limits,
        observer: Observer,
        admin: AdapterAdmin | None = None,
    ) -> None:
        """`admin`: the engine's LoRA adapters at run time (None: a model of another name, on
        the base model's engine)."""
        super().__init__(name)
        self.llm = llm
        self.admin = admin
        self.limits = limits
        self.observer = observer
        observer.metrics.track_engine(llm.running, llm.waiting)
        if admin is not None:
            observer.metrics.track_lora(admin.lora_requests)
        observer.metrics.track_ready(lambda: bool(self.ready) and llm.ready())
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
        return self.llm.ready()

    def get_input_types(self) -> list[dict[str, Any]]:
        """V2 model metadata: the required input (the optional ones are in the config)."""
        return [_metadata(spec) for spec in INPUTS if not spec.optional]

    def get_output_types(self) -> list[dict[str, Any]]:
        return [_metadata(spec) for spec in OUTPUTS if not spec.optional]

    async def predict(
        self,
        payload: InferRequest,
        headers: dict[str, str] | None = None,
        response_headers: dict[str, str] | None = None,
    ) -> InferResponse:
        if not isinstance(payload, InferRequest):
            raise InvalidInput("expected a V2 inference request")
        try:
            decoded = v2_requests.decode_infer_request(payload, self.limits, streaming=False)
            protocol = "grpc" if payload.from_grpc else "rest"
            completions = await self.complete_all(decoded.requests, protocol)
        except PredictorError as exc:
            raise kserve_error(exc, payload.from_grpc) from exc
        except Exception as exc:
            log.exception("V2 infer failed")
            raise kserve_error(exc, payload.from_grpc) from exc
        return v2_responses.encode_infer_response(payload, self.name, decoded, completions)

    @property
    def statistics(self) -> InferenceStatistics:
        """Triton's ModelStatistics figures, recorded with the metrics."""
        return self.observer.metrics.statistics

    def stream(self, request: GenerateRequest, protocol: str) -> ObservedStream:
        """Token events of one request, measured; closing the iterator aborts the request.

        Raises InvalidRequest / Overloaded / EngineUnavailable before the first event.
        """
        return self.observer.observe(self.llm.generate(request), protocol, request)

    async def stream_all(
        self, requests: Sequence[GenerateRequest], protocol: str
    ) -> list[ObservedStream]:
        """Several prompts as one unit (all admitted or none), each stream measured."""
        try:
            streams = await self.llm.generate_all(requests)
        except PredictorError as exc:
            await self.observer.rejected(requests, protocol, exc)
            raise
        return [
            self.observer.observe(s, protocol, r) for s, r in zip(streams, requests, strict=True)
        ]

    async def complete_all(
        self, requests: Sequence[GenerateRequest], protocol: str
    ) -> list[Completion]:
        """Every prompt's whole answer; the first failure cancels the others at once."""
        return await complete_all(await self.stream_all(requests, protocol))


def _metadata(spec: TensorSpec) -> dict[str, Any]:
    return {"name": spec.name, "datatype": spec.datatype, "shape": list(spec.dims)}


class AdapterPredictor(LLMPredictor):
    """A LoRA adapter served as a model of its own name (vLLM's --lora-modules), or, with no
    path, another name of the model itself (vLLM's --served-model-name after its first): every
    protocol finds it by that name (the OpenAI `model`, the V2 / OIP / Triton path), and its
    requests run (with the adapter) on the base model's engine, which the base model starts and
    stops."""

    def __init__(self, name: str, base: LLMPredictor, path: str | None) -> None:
        Model.__init__(self, name)  # not LLMPredictor's: the base model's gauges stand
        self.llm = AdapterClient(base.llm, name if path is not None else None)
        self.admin = None  # the base model's
        self.limits = base.limits
        self.observer = base.observer
        self.lineage = (base.name, path) if path is not None else None
        self.engine = False
