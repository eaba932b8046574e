"""The MSE scale search (predictor.model.scale_search) makes gptqmodel's choices bit for bit, in
C (scale_search.c) and in torch, and the checkpoint is the one gptqmodel makes."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from predictor.model import scale_search
from predictor.model.recipe import Recipe, quantize_checkpoint
from predictor.model.scale_search import vectorised_scale_search

needs_compiler = pytest.mark.skipif(
    not any(shutil.which(cc) for cc in ("cc", "gcc", "g++", "clang")), reason="no C compiler"
)
PATHS = [pytest.param("c", marks=needs_compiler), "torch"]


def _quantizer(sym: bool = False, bits: int = 4, mse: float = 2.0) -> object:
    from gptqmodel import QuantizeConfig
    from gptqmodel.quantization.quantizer import Quantizer

    quantizer = Quantizer(QuantizeConfig(bits=bits, group_size=32, sym=sym, mse=mse))
    quantizer.configure(perchannel=True)
    return quantizer


@pytest.fixture(params=PATHS)
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The search in C, or in torch as where no C compiler is found."""
    if request.param == "c":
        assert scale_search._native_search() is not None, "scale_search.c is not used here"
    else:
        monkeypatch.setattr(scale_search, "_native_search", lambda: None)
    return str(request.param)


@pytest.mark.parametrize(
    ("sym", "bits", "mse", "width"),
    [
        (False, 4, 2.0, 32),
        (True, 4, 2.0, 32),
        (False, 3, 2.4, 32),
        (False, 4, 2.0, 7),
        (False, 4, 0.0, 32),  # no search: the range alone
        (True, 4, 0.0, 32),
    ],
)
def test_every_group_gets_the_loops_scale_and_zero(
    path: str, sym: bool, bits: int, mse: float, width: int
) -> None:
    generator = torch.Generator().manual_seed(7)
    weights = torch.randn(576, 32 * 12, generator=generator) * 0.05
    weights[:, :32] *= 40  # outliers: the search shrinks the range
    weights[3, 32:64] = 0.0  # an all-zero row of a group
    weights[4, :] = weights[4, :].abs()  # rows of one sign: the range's other end is 0
    weights[5, :] = -weights[5, :].abs()
    for start in range(0, weights.shape[1], 32):
        group = weights[:, start : start + width]  # a strided view, as in GPTQ's column loop
        loop, ours = _quantizer(sym, bits, mse), _quantizer(sym, bits, mse)
        loop.find_params(group.clone(), weight=True)  # type: ignore[attr-defined]
        with vectorised_scale_search():
            ours.find_params(group, weight=True)  # type: ignore[attr-defined]
        assert torch.equal(loop.scale, ours.scale)  # type: ignore[attr-defined]
        assert torch.equal(loop.zero, ours.zero)  # type: ignore[attr-defined]


@needs_compiler
def test_the_kernel_sums_as_torch_does_or_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    native = scale_search._native_search()
    assert native is not None and native.max_columns >= 32  # torch 2.13 on x86: its order
    assert scale_search._native_fits(torch.zeros(4, 32), 2.0, native)
    assert not scale_search._native_fits(torch.zeros(4, 32), 2.4, native)  # squares only
    assert not scale_search._native_fits(torch.zeros(4, 32).double(), 2.0, native)
    assert not scale_search._native_fits(torch.zeros(32, 4).t(), 2.0, native)  # strided columns
    assert not scale_search._native_fits(torch.zeros(4, native.max_columns + 1), 2.0, native)

    real_sum = torch.sum

    def reversed_sum(x: torch.Tensor, dim: int) -> torch.Tensor:  # another order of addition
        return real_sum(x.flip(dim), dim)

    scale_search._native_search.cache_clear()
    monkeypatch.setattr(torch, "sum", reversed_sum)
    try:
        assert scale_search._native_search() is None
    finally:
        monkeypatch.undo()
        scale_search._native_search.cache_clear()


@needs_compiler
def test_a_search_split_over_threads_is_the_search_of_one() -> None:
    native = scale_search._native_search()
    assert native is not None
    quantizer = _quantizer()
    shrink = scale_search._shrinks(quantizer, torch.float32, torch.device("cpu"))
    maxq = quantizer.maxq  # type: ignore[attr-defined]
    generator = torch.Generator().manual_seed(3)
    weights = torch.randn(1537, 96, generator=generator) * 0.05  # rows not a multiple of 2, 3
    for group, candidates in ((weights[:, 32:64], shrink), (weights[:2, :32], None)):
        one = scale_search._find_native(native, group, candidates, maxq, False, threads=1)
        for threads in (2, 3, 8):  # 8 threads for 2 rows: 2 threads
            split = scale_search._find_native(native, group, candidates, maxq, False, threads)
            assert torch.equal(one[0], split[0]) and torch.equal(one[1], split[1])


def test_a_search_runs_on_every_core_only_while_it_is_the_only_one() -> None:
    searches = scale_search._Searches()
    with searches.running() as alone:
        assert alone
        with searches.running() as second:  # the other solve worker's, at the same time
            assert not second
    with searches.running() as alone:
        assert alone


def test_the_search_is_gptqmodels_own_again_after_the_block() -> None:
    from gptqmodel.quantization.quantizer import Quantizer

    original = Quantizer.find_params
    with vectorised_scale_search():
        assert Quantizer.find_params is not original
    assert Quantizer.find_params is original


def test_the_checkpoint_is_bit_for_bit_the_one_gptqmodel_makes(
    path: str, tiny_dense_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from contextlib import nullcontext

    from safetensors.torch import load_file

    from predictor.model import capture
    from predictor.model.recipe import calibration_texts

    texts = calibration_texts()[:16]
    recipe = Recipe(group_size=64)
    # one calibration dtype for both ("auto" is a timing, which may differ between the two)
    quantize_checkpoint(tiny_dense_dir, tmp_path / "ours", texts, recipe=recipe, dtype="float32")
    monkeypatch.setattr(scale_search, "vectorised_scale_search", nullcontext)
    monkeypatch.setattr(capture, "lean_capture", nullcontext)  # gptqmodel's own forwards too
    quantize_checkpoint(tiny_dense_dir, tmp_path / "loop", texts, recipe=recipe, dtype="float32")
    ours = load_file(tmp_path / "ours" / "model.safetensors")
    theirs = load_file(tmp_path / "loop" / "model.safetensors")
    assert ours.keys() == theirs.keys()
    assert [name for name in ours if not torch.equal(ours[name], theirs[name])] == []
