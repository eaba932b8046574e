"""predictor/pb/ is what `make proto` generates from proto/ (no hand edits, no drift)."""

from __future__ import annotations

from pathlib import Path

from tests.support import REPO
from tools.gen_proto import main as generate


def test_generated_code_matches_proto(tmp_path: Path) -> None:
    assert generate(tmp_path) == 0
    for name in ("model_stream_infer_pb2.py", "model_stream_infer_pb2.pyi", "__init__.py"):
        assert (tmp_path / name).read_text() == (REPO / "predictor" / "pb" / name).read_text(), name


def test_stream_response_shares_kserve_descriptor_pool() -> None:
    from kserve.protocol.grpc import grpc_predict_v2_pb2 as pb

    from predictor.pb.model_stream_infer_pb2 import ModelStreamInferResponse

    field = ModelStreamInferResponse.DESCRIPTOR.fields_by_name["infer_response"]
    assert field.message_type is pb.ModelInferResponse.DESCRIPTOR
    assert ModelStreamInferResponse.DESCRIPTOR.full_name == "inference.ModelStreamInferResponse"
