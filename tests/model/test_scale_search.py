"""The vectorised MSE scale search (predictor.model.scale_search) makes gptqmodel's choices."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from predictor.model.quantize import Recipe, quantize_checkpoint
from predictor.model.scale_search import vectorised_scale_search


def _quantizer(sym: bool = False, bits: int = 4, mse: float = 2.0) -> object:
    from gptqmodel import QuantizeConfig
    from gptqmodel.quantization.quantizer import Quantizer

    quantizer = Quantizer(QuantizeConfig(bits=bits, group_size=32, sym=sym, mse=mse))
    quantizer.configure(perchannel=True)
    return quantizer


@pytest.mark.parametrize(("sym", "bits", "mse"), [(False, 4, 2.0), (True, 4, 2.0), (False, 3, 2.4)])
def test_every_group_gets_the_loops_scale_and_zero(sym: bool, bits: int, mse: float) -> None:
    generator = torch.Generator().manual_seed(7)
    weights = torch.randn(96, 32 * 12, generator=generator) * 0.05
    weights[:, :32] *= 40  # outliers: the search shrinks the range
    weights[3, 32:64] = 0.0  # an all-zero row of a group
    for start in range(0, weights.shape[1], 32):
        group = weights[:, start : start + 32].clone()
        loop, vectorised = _quantizer(sym, bits, mse), _quantizer(sym, bits, mse)
        loop.find_params(group, weight=True)  # type: ignore[attr-defined]
        with vectorised_scale_search():
            vectorised.find_params(group, weight=True)  # type: ignore[attr-defined]
        assert torch.equal(loop.scale, vectorised.scale)  # type: ignore[attr-defined]
        assert torch.equal(loop.zero, vectorised.zero)  # type: ignore[attr-defined]


def test_the_search_is_gptqmodels_own_again_after_the_block() -> None:
    from gptqmodel.quantization.quantizer import Quantizer

    original = Quantizer.find_params
    with vectorised_scale_search():
        assert Quantizer.find_params is not original
    assert Quantizer.find_params is original


def test_the_checkpoint_is_bit_for_bit_the_one_gptqmodel_makes(
    tiny_dense_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from contextlib import nullcontext

    from safetensors.torch import load_file

    from predictor.model import scale_search
    from predictor.model.quantize import calibration_texts

    texts = calibration_texts()[:16]
    recipe = Recipe(group_size=64)
    # one calibration dtype for both ("auto" is a timing, which may differ between the two)
    quantize_checkpoint(
        tiny_dense_dir, tmp_path / "vectorised", texts, recipe=recipe, dtype="float32"
    )
    monkeypatch.setattr(scale_search, "vectorised_scale_search", nullcontext)
    quantize_checkpoint(tiny_dense_dir, tmp_path / "loop", texts, recipe=recipe, dtype="float32")
    ours = load_file(tmp_path / "vectorised" / "model.safetensors")
    theirs = load_file(tmp_path / "loop" / "model.safetensors")
    assert ours.keys() == theirs.keys()
    assert [name for name in ours if not torch.equal(ours[name], theirs[name])] == []
