"""What config.json alone decides, before any weight is read: the family and the bit width are
refused in a moment, and a sliding window caps the context."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from load.random_gptq import SHAPES, Layout, write_checkpoint
from predictor.errors import UnsupportedModel
from predictor.model.loader import check_checkpoint, load_checkpoint


def with_config(path: Path, **changes: object) -> Path:
    config = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if key in ("bits", "lm_head", "checkpoint_format"):
            config["quantization_config"][key] = value
        else:
            config[key] = value
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"model_type": "gemma3"}, "model type 'gemma3' is not supported"),
        (
            {"model_type": "falcon"},
            "supported: llama, mistral, qwen2, qwen3, phi3, gemma2, gemma3_text",
        ),
        ({"bits": 3}, "3-bit GPTQ is not supported"),
        ({"partial_rotary_factor": 0.75}, "partial_rotary_factor 0.75 is not supported"),
    ],
)
def test_unsupported_checkpoints_are_refused_from_config_alone(
    changes: dict[str, object], words: str, tmp_path: Path, tokenizer_dir: Path
) -> None:
    path = write_checkpoint(tmp_path / "m", SHAPES["tiny"], Layout(), tokenizer_dir)
    with_config(path, **changes)
    (path / "model.safetensors").write_bytes(b"not read")  # the weights are never opened
    start = time.monotonic()
    with pytest.raises(UnsupportedModel, match=words):
        check_checkpoint(path)
    with pytest.raises(UnsupportedModel, match=words):
        load_checkpoint(path, device="cpu")
    assert time.monotonic() - start < 1.0


@pytest.mark.parametrize(("family", "window", "length"), [
    ("mistral", 256, 256), ("mistral", None, 1024), ("qwen2", 300, 300), ("qwen3", None, 1024),
    ("phi3", 256, 256), ("phi3", None, 1024), ("gemma2", 512, 512),
    ("gemma3_text", 512, 1024),  # masked layer by layer, not capped
])  # fmt: skip
def test_a_sliding_window_caps_the_context(
    family: str, window: int | None, length: int, tmp_path: Path, tokenizer_dir: Path
) -> None:
    path = write_checkpoint(tmp_path / family, SHAPES["tiny"], Layout(), tokenizer_dir,
                            family=family, window=window)  # fmt: skip
    assert load_checkpoint(path, device="cpu").context_length == length


@pytest.mark.parametrize(
    ("stored", "served"),
    [(torch.float16, torch.bfloat16), (torch.bfloat16, torch.bfloat16),
     (torch.float32, torch.float32)],
)  # fmt: skip
def test_fp16_checkpoints_are_served_in_bf16_on_a_cpu(
    stored: torch.dtype, served: torch.dtype, tmp_path: Path, tokenizer_dir: Path
) -> None:
    """fp16's plain tensors become bf16 once at load (the native kernels' dtype); the
    quantized weights are the same codes and scales either way."""
    path = write_checkpoint(tmp_path / "m", SHAPES["tiny"], Layout(dtype=stored), tokenizer_dir)
    model = load_checkpoint(path, device="cpu").model
    assert model.get_input_embeddings().weight.dtype == served
    assert model.model.norm.weight.dtype == served
