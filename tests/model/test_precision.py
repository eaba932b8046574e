"""The calibration dtype chosen by measurement, and the dtype a checkpoint stores (precision)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from predictor.model import precision
from predictor.model.precision import calibration_dtype, keep_unquantized_in


def _timings(monkeypatch: pytest.MonkeyPatch, bf16: float, fp32: float) -> list[tuple[int, int]]:
    shapes: list[tuple[int, int]] = []

    def seconds(dtype: torch.dtype, inner: int, outer: int, repeats: int = 5) -> float:
        shapes.append((inner, outer))
        return bf16 if dtype == torch.bfloat16 else fp32

    monkeypatch.setattr(precision, "matmul_seconds", seconds)
    return shapes


def test_bf16_is_chosen_only_where_it_is_clearly_faster(
    tiny_dense_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = json.loads((tiny_dense_dir / "config.json").read_text())
    shapes = _timings(monkeypatch, bf16=1.0, fp32=2.0)  # AVX-512-BF16: native bf16
    assert calibration_dtype(tiny_dense_dir) == ("bfloat16", "bf16 matmul 2.00x fp32's here")
    assert set(shapes) == {(config["hidden_size"], config["intermediate_size"])}  # the MLP's
    _timings(monkeypatch, bf16=3.0, fp32=1.0)  # AVX2 only: bf16 emulated
    assert calibration_dtype(tiny_dense_dir)[0] == "float32"
    _timings(monkeypatch, bf16=1.0, fp32=1.1)  # within the margin: fp32, which is exact
    assert calibration_dtype(tiny_dense_dir)[0] == "float32"


def test_an_asked_for_dtype_is_not_measured(
    tiny_dense_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shapes = _timings(monkeypatch, bf16=1.0, fp32=9.0)
    assert calibration_dtype(tiny_dense_dir, "float32") == ("float32", "asked for")
    assert shapes == []
    with pytest.raises(ValueError, match="float16"):
        calibration_dtype(tiny_dense_dir, "float16")


def test_the_real_measurement_names_one_of_the_two(tiny_dense_dir: Path) -> None:
    dtype, why = calibration_dtype(tiny_dense_dir)
    assert dtype in ("bfloat16", "float32") and why.startswith("bf16 matmul ")
    assert precision.matmul_seconds(torch.float32, 64, 128, repeats=2) > 0


def test_unquantized_weights_are_stored_in_bf16_and_gptqs_own_tensors_stay(
    tmp_path: Path,
) -> None:
    tensors = {
        "model.embed_tokens.weight": torch.randn(8, 4),
        "model.norm.weight": torch.ones(4),
        "model.layers.0.mlp.up_proj.qweight": torch.arange(8, dtype=torch.int32).reshape(2, 4),
        "model.layers.0.mlp.up_proj.qzeros": torch.ones(1, 1, dtype=torch.int32),
        "model.layers.0.mlp.up_proj.scales": torch.rand(1, 4, dtype=torch.float16),
        "model.layers.0.mlp.up_proj.g_idx": torch.zeros(4, dtype=torch.int32),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "float32", "hidden_size": 4}))
    keep_unquantized_in(tmp_path)
    stored = load_file(str(tmp_path / "model.safetensors"))
    dtypes = {name.rsplit(".", 1)[-1]: tensor.dtype for name, tensor in stored.items()}
    assert stored["model.norm.weight"].dtype == torch.bfloat16
    assert dtypes == {"weight": torch.bfloat16, "qweight": torch.int32, "qzeros": torch.int32,
                      "scales": torch.float16, "g_idx": torch.int32}  # fmt: skip
    for name, tensor in tensors.items():
        assert torch.equal(stored[name], tensor.to(stored[name].dtype)), name
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as handle:
        assert handle.metadata() == {"format": "pt"}
    assert json.loads((tmp_path / "config.json").read_text()) == {
        "dtype": "bfloat16",
        "hidden_size": 4,
    }


def test_the_tiny_checkpoint_is_stored_in_bf16(tiny_gptq_dir: Path) -> None:
    """Whatever dtype its calibration ran in (the session fixture's is measured)."""
    stored = load_file(str(tiny_gptq_dir / "model.safetensors"))
    floats = {t.dtype for name, t in stored.items() if not name.endswith(".scales")}
    assert floats - {torch.int32} == {torch.bfloat16}
    assert json.loads((tiny_gptq_dir / "config.json").read_text())["dtype"] == "bfloat16"
