"""Triton's model configuration, statistics and repository index: our model -> Triton's answers.

Each answer is built once as the JSON Triton's REST API returns (numbers as numbers), and the
gRPC message is parsed from that same dict, so the two cannot drift apart (a key that is not a
field of Triton's message fails the parse).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from google.protobuf import json_format

from predictor.errors import VersionMissing
from predictor.observability.statistics import Duration, StatisticsSnapshot
from predictor.pb import triton_model_pb2 as pb
from predictor.protocols.triton.tensors import INPUTS, OUTPUTS, TensorSpec

VERSION = "1"  # one model, one version: what Triton reports for a model without versions
BACKEND = "gptq-predictor"


def check_version(name: str, version: str) -> None:
    if version not in ("", VERSION):
        raise VersionMissing(f"Request for unknown model: '{name}' version {version} is not found")


@dataclass(frozen=True)
class ModelView:
    """What the answers need to know of a served model."""

    name: str
    ready: bool
    statistics: StatisticsSnapshot


def _data_type(spec: TensorSpec) -> str:
    return "TYPE_STRING" if spec.datatype == "BYTES" else f"TYPE_{spec.datatype}"


def model_config(model: ModelView) -> dict[str, Any]:
    """Triton's config JSON. max_batch_size 0: requests carry no batch dimension, as the vLLM
    backend declares, since the engine batches them itself; decoupled: responses stream."""
    return {
        "name": model.name,
        "platform": "",
        "backend": BACKEND,
        "max_batch_size": 0,
        "input": [
            {
                "name": s.name,
                "data_type": _data_type(s),
                "dims": list(s.dims),
                "optional": s.optional,
            }
            for s in INPUTS
        ],
        "output": [
            {"name": s.name, "data_type": _data_type(s), "dims": list(s.dims)} for s in OUTPUTS
        ],
        "model_transaction_policy": {"decoupled": True},
    }


def _duration(d: Duration) -> dict[str, int]:
    return {"count": d.count, "ns": d.ns}


def model_statistics(model: ModelView) -> dict[str, Any]:
    s = model.statistics
    return {
        "name": model.name,
        "version": VERSION,
        "last_inference": s.last_inference_ms,
        "inference_count": s.inference_count,
        "execution_count": s.execution_count,
        "inference_stats": {
            "success": _duration(s.success),
            "fail": _duration(s.fail),
            "queue": _duration(s.queue),
            "compute_input": _duration(s.compute_input),
            "compute_infer": _duration(s.compute_infer),
            "compute_output": _duration(s.compute_output),
        },
    }


def statistics_response(models: list[ModelView]) -> dict[str, Any]:
    return {"model_stats": [model_statistics(m) for m in models]}


def repository_index(models: list[ModelView], ready_only: bool) -> list[dict[str, Any]]:
    index = []
    for model in models:
        if ready_only and not model.ready:
            continue
        entry = {"name": model.name, "version": VERSION}
        entry["state"] = "READY" if model.ready else "UNAVAILABLE"
        if not model.ready:
            entry["reason"] = "not ready (starting or draining)"
        index.append(entry)
    return index


# -- gRPC: the same answers as Triton's messages ------------------------------------------------


def config_message(model: ModelView) -> pb.ModelConfigResponse:
    return json_format.ParseDict({"config": model_config(model)}, pb.ModelConfigResponse())


def statistics_message(models: list[ModelView]) -> pb.ModelStatisticsResponse:
    return json_format.ParseDict(statistics_response(models), pb.ModelStatisticsResponse())


def index_message(models: list[ModelView], ready_only: bool) -> pb.RepositoryIndexResponse:
    return json_format.ParseDict(
        {"models": repository_index(models, ready_only)}, pb.RepositoryIndexResponse()
    )
