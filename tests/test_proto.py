"""predictor/pb/ is what `make proto` generates from proto/ (no hand edits, no drift), and our
Triton messages use Triton's names and field numbers (checked against tritonclient's own)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from google.protobuf.descriptor import Descriptor

from tests.support import REPO
from tools.gen_proto import main as generate

GENERATED = [
    "model_stream_infer_pb2.py",
    "model_stream_infer_pb2.pyi",
    "triton_model_pb2.py",
    "triton_model_pb2.pyi",
    "__init__.py",
]


def test_generated_code_matches_proto(tmp_path: Path) -> None:
    assert generate(tmp_path) == 0
    for name in GENERATED:
        assert (tmp_path / name).read_text() == (REPO / "predictor" / "pb" / name).read_text(), name


def test_stream_response_shares_kserve_descriptor_pool() -> None:
    from kserve.protocol.grpc import grpc_predict_v2_pb2 as pb

    from predictor.pb.model_stream_infer_pb2 import ModelStreamInferResponse

    field = ModelStreamInferResponse.DESCRIPTOR.fields_by_name["infer_response"]
    assert field.message_type is pb.ModelInferResponse.DESCRIPTOR
    assert ModelStreamInferResponse.DESCRIPTOR.full_name == "inference.ModelStreamInferResponse"


def _messages(descriptor: Descriptor) -> list[Descriptor]:
    nested = [m for m in descriptor.nested_types if not m.GetOptions().map_entry]
    return [descriptor, *(m for n in nested for m in _messages(n))]


def test_triton_messages_match_tritonclient() -> None:
    from predictor.pb import triton_model_pb2

    ours = [m for d in triton_model_pb2.DESCRIPTOR.message_types_by_name.values()
            for m in _messages(d)]  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "tests.clients.triton_descriptors", *(m.full_name for m in ours)],
        cwd=REPO, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    theirs = json.loads(done.stdout)
    for message in ours:
        for field in message.fields:
            kind = field.message_type or field.enum_type
            mine = [field.number, field.type, field.label, kind.full_name if kind else ""]
            assert theirs[message.full_name][field.name] == mine, (message.full_name, field.name)
    enum = triton_model_pb2.DESCRIPTOR.enum_types_by_name["DataType"]
    assert {v.name: v.number for v in enum.values} == theirs["inference.DataType"]


def test_kserve_servicer_lacks_the_triton_rpcs_we_add() -> None:
    # ours are a generic handler consulted after KServe's registered methods: were KServe to
    # register one of these names, its method would answer instead of ours
    from kserve.protocol.grpc import grpc_predict_v2_pb2 as pb

    kserve_methods = {
        m.name for m in pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods
    }
    ours = {"ModelStreamInfer", "ModelConfig", "ModelStatistics", "RepositoryIndex"}
    assert not kserve_methods & ours
