"""What every transport sees of a served model: a small Protocol, and the lookup by name."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from predictor.engine.client import EngineClient, Stream
from predictor.errors import EngineUnavailable, ModelMissing
from predictor.observability.statistics import InferenceStatistics
from predictor.protocols.limits import Limits
from predictor.protocols.triton.status import ModelView, check_version
from predictor.types import Completion, GenerateRequest


@runtime_checkable
class ServedModel(Protocol):
    name: str
    llm: EngineClient
    limits: Limits
    ready: bool
    statistics: InferenceStatistics
    lineage: tuple[str, str] | None  # a LoRA adapter's (base model, path); None: the base

    def stream(self, request: GenerateRequest, protocol: str) -> Stream: ...

    async def stream_all(
        self, requests: Sequence[GenerateRequest], protocol: str
    ) -> Sequence[Stream]: ...

    async def complete_all(
        self, requests: Sequence[GenerateRequest], protocol: str
    ) -> list[Completion]: ...


Resolve = Callable[[str], ServedModel | None]
Models = Callable[[], list[ServedModel]]


def ready_model(resolve: Resolve, name: str) -> ServedModel:
    """The served model of that name, ready for requests; else ModelMissing / EngineUnavailable."""
    model = resolve(name)
    if model is None:
        raise ModelMissing(f"Model with name {name} does not exist.")
    if not model.ready or not model.llm.health():
        raise EngineUnavailable(f"Model with name {name} is not ready.")
    return model


def find(resolve: Resolve, name: str, version: str) -> ServedModel:
    """The served model of that name and version (any state); else ModelMissing."""
    model = resolve(name)
    if model is None:
        raise ModelMissing(f"Request for unknown model: '{name}' is not found")
    check_version(name, version)
    return model


def selected(resolve: Resolve, models: Models, name: str, version: str) -> list[ServedModel]:
    """Every model for an empty name (Triton's "all models"), else the one named."""
    return [find(resolve, name, version)] if name else models()


def view(model: ServedModel) -> ModelView:
    """What Triton's configuration, statistics and index answers need of a model."""
    return ModelView(model.name, model.ready and model.llm.ready(), model.statistics.snapshot())
