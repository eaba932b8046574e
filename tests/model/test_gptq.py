"""predictor.model.gptq: GPTQ checkpoints read without gptqmodel, checked against gptqmodel's own
loading of the same random checkpoints (every layout the GPU path serves)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from load.random_gptq import SHAPES, Layout, write_checkpoint
from predictor.errors import CheckpointError
from predictor.model.gptq import GPTQLayout, load_gptq_model
from predictor.model.loader import check_checkpoint, load_checkpoint
from predictor.packing import (
    pack_columns,
    pack_rows,
    shift_zero_fields,
    unpack_columns,
    unpack_rows,
)

LAYOUTS = {
    "4bit-g32-asym-v1": Layout(4, 32, sym=False),
    "4bit-g32-sym-v2-act-order": Layout(
        4, 32, sym=True, desc_act=True, checkpoint_format="gptq_v2"
    ),  # fmt: skip
    "8bit-g64-asym-v1": Layout(8, 64, sym=False),
    "4bit-per-channel-sym-v1-fp16": Layout(4, -1, sym=True, dtype=torch.float16),
}


@pytest.mark.parametrize("bits", [4, 8])
def test_packing_round_trips(bits: int) -> None:
    codes = torch.randint(0, 1 << bits, (64, 24), dtype=torch.int32)
    assert torch.equal(unpack_rows(pack_rows(codes, bits), bits, 64), codes)
    assert torch.equal(unpack_columns(pack_columns(codes, bits), bits, 24), codes)
    packed = pack_columns(codes, bits)
    assert torch.equal(shift_zero_fields(shift_zero_fields(packed, bits, -1), bits, 1), packed)


def test_v1_zero_points_are_read_as_gptqmodel_writes_them() -> None:
    """v1 stores zero - 1 word-wide: a zero point of 0 borrows from its neighbour field, and
    reading adds back word-wide, so every field comes back (field-wise, 0 would read as 16)."""
    zeros = torch.tensor([[0, 5, 15, 0, 8, 1, 0, 0]], dtype=torch.int32)
    stored = shift_zero_fields(pack_columns(zeros, 4), 4, -1)
    assert torch.equal(unpack_columns(shift_zero_fields(stored, 4, 1), 4, 8), zeros)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_random_checkpoint_logits_equal_gptqmodels(
    name: str, tmp_path: Path, tokenizer_dir: Path
) -> None:
    """Our reading of each layout gives the logits of gptqmodel's own reading (its torch kernel,
    which dequantizes in its own order and precision: equal within rounding); the dequantized
    kernel is our reading expanded, bit for bit."""
    layout = LAYOUTS[name]
    path = write_checkpoint(tmp_path / name, SHAPES["tiny"], layout, tokenizer_dir, seed=3)
    reference = load_checkpoint(path, device="cpu", threads=1, kernel="gptq_torch").model
    dense = load_checkpoint(path, device="cpu", threads=1, kernel="dequantized", dtype=layout.dtype)
    dense = dense.model
    ours = load_gptq_model(path, check_checkpoint(path), torch.device("cpu"), layout.dtype)
    if layout.desc_act:
        assert ours.model.layers[0].self_attn.q_proj.perm is not None  # rows were reordered
    generator = torch.Generator().manual_seed(0)
    for name, module in ours.named_modules():  # every projection: a layout slip is O(1) off
        if not hasattr(module, "qweight"):
            continue
        x = torch.randn((4, module.in_features), generator=generator).to(layout.dtype)
        with torch.inference_mode():
            got, expected = module(x).float(), reference.get_submodule(name)(x).float()
        assert float((got - expected).norm() / expected.norm()) < 1e-2, name
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314, 253, 1345, 30, 378]])
    with torch.inference_mode():
        expected, got = reference(ids).logits.float(), ours(ids).logits
        assert torch.equal(dense(ids).logits, got)
    assert got.dtype == layout.dtype
    got = got.float()
    # through two layers of 16-bit rounding, each implementation its own: close, not equal
    assert float((got - expected).norm() / expected.norm()) < 2e-2
    assert float((got.argmax(-1) == expected.argmax(-1)).float().mean()) >= 0.8


def test_unserved_layouts_are_refused_naming_them() -> None:
    with pytest.raises(CheckpointError, match="3 bits"):
        GPTQLayout.from_config({"bits": 3})
    with pytest.raises(CheckpointError, match="'marlin'"):
        GPTQLayout.from_config({"bits": 4, "checkpoint_format": "marlin"})


def test_missing_tensors_are_named(tmp_path: Path, tokenizer_dir: Path) -> None:
    from safetensors.torch import load_file, save_file

    path = write_checkpoint(tmp_path / "m", SHAPES["tiny"], Layout(), tokenizer_dir)
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.post_attention_layernorm.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="post_attention_layernorm"):
        load_gptq_model(path, check_checkpoint(path), torch.device("cpu"), torch.bfloat16)
