"""predictor.model.block_update: GPTQ's 128-column block in C, against gptqmodel's eager loop.

The kernel must give what the loop in GPTQ.quantize gives, bit for bit: the quantized columns,
the scaled errors, the losses and the block's updated weights; and a whole checkpoint quantized
with it must equal the one gptqmodel's own loop makes."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch

from predictor.model import block_update, internals
from predictor.model.recipe import Recipe, calibration_texts, quantize_checkpoint

pytestmark = pytest.mark.skipif(block_update._kernel() is None, reason="no C compiler here")


def _eager(
    work: torch.Tensor, hinv: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
    column_group: torch.Tensor, maxq: int,
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """GPTQ.quantize's eager loop over one block (gptqmodel 7.6.0, quantizer.quantize inlined)."""
    W1 = work.clone()
    Q1, Err1, Losses1 = torch.zeros_like(W1), torch.zeros_like(W1), torch.zeros_like(W1)
    top = torch.tensor(maxq)
    for i in range(W1.shape[1]):
        w, d = W1[:, i], hinv[i, i]
        s, z = scale[column_group[i]].unsqueeze(1), zero[column_group[i]].unsqueeze(1)
        x = w.unsqueeze(1)
        q = (s * (torch.clamp(torch.round(x / s) + z, 0, top) - z)).flatten()
        Q1[:, i] = q
        delta = Err1[:, i]
        torch.sub(w, q, out=delta)
        Losses1[:, i] = delta.square() / d.square()
        delta.div_(d)
        W1[:, i:] -= delta.unsqueeze(1) * hinv[i, i:]
    return W1, Q1, Err1, Losses1


@pytest.mark.parametrize("rows", [1, 7, 192, 576])
def test_a_block_is_the_eager_loops_bit_for_bit(rows: int) -> None:
    generator = torch.Generator().manual_seed(rows)
    work = torch.randn(rows, 128, generator=generator) * 0.05
    factor = torch.randn(128, 128, generator=generator).triu() * 0.1
    factor.diagonal().copy_(torch.rand(128, generator=generator) + 0.5)
    hinv = factor[:, :]  # upper triangular, as GPTQ's inverse Cholesky factor
    groups = 4
    low = work.reshape(rows, groups, 32).amin(2).T.clamp(max=0)
    high = work.reshape(rows, groups, 32).amax(2).T.clamp(min=0)
    scale = (high - low) / 15
    zero = torch.round(-low / scale)
    column_group = torch.arange(128, dtype=torch.int32) // 32
    work[0, 5] = float("nan") if rows > 1 else work[0, 5]  # a NaN passes the clamp as in torch
    expected = _eager(work, hinv, scale, zero, column_group, 15)

    ours = work.clone()
    quantized, errors, losses = (torch.zeros_like(work) for _ in range(3))
    kernel = block_update._kernel()
    block_update.run_block(kernel, ours, hinv, scale, zero, column_group, quantized, errors,
                           losses, 15)  # fmt: skip
    for name, mine, theirs in zip(
        ("work", "quantized", "errors", "losses"), (ours, quantized, errors, losses), expected,
        strict=True,
    ):  # fmt: skip
        assert torch.equal(mine.isnan(), theirs.isnan()), name
        assert torch.equal(mine.nan_to_num(), theirs.nan_to_num()), name


def test_shapes_other_than_gptqmodels_are_refused() -> None:
    kernel = block_update._kernel()
    work = torch.zeros(4, 64)
    with pytest.raises(ValueError, match="shapes"):
        block_update.run_block(kernel, work, torch.eye(128), torch.ones(1, 4), torch.ones(1, 4),
                               torch.zeros(128, dtype=torch.int32), work, work, work, 15)  # fmt: skip


def _checkpoint(
    source: Path, out: Path, fused: bool, monkeypatch: pytest.MonkeyPatch
) -> dict[str, torch.Tensor]:
    """quantize_checkpoint's build, with the kernel (as `make model`) or without it."""
    from safetensors.torch import load_file

    blocks = []
    run_block = block_update.run_block

    def counted(*args: Any) -> None:
        blocks.append(args[1].shape)
        run_block(*args)

    monkeypatch.setattr(block_update, "run_block", counted)
    if not fused:
        monkeypatch.setattr(block_update, "fused_block_update", nullcontext)
    update = internals.gptq_cuda_module().gptq_block_update
    quantize_checkpoint(source, out, calibration_texts()[:16], recipe=Recipe(group_size=32),
                        dtype="float32")  # fmt: skip
    monkeypatch.undo()
    assert internals.gptq_cuda_module().gptq_block_update is update  # put back
    # the tiny model's 128- and 256-wide inputs: 128-column blocks, 2 layers x 7 modules
    assert len(blocks) == (2 * (6 + 2) if fused else 0)
    return load_file(out / "model.safetensors")


def test_a_checkpoint_with_the_kernel_is_gptqmodels_own(
    tiny_dense_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    theirs = _checkpoint(tiny_dense_dir, tmp_path / "theirs", False, monkeypatch)
    ours = _checkpoint(tiny_dense_dir, tmp_path / "ours", True, monkeypatch)
    assert ours.keys() == theirs.keys()
    assert [name for name in theirs if not torch.equal(ours[name], theirs[name])] == []


def test_the_widened_method_keeps_gptqmodels_file_and_line_numbers() -> None:
    import inspect

    original = inspect.unwrap(internals.gptq_class().quantize)
    widened = block_update._widened(internals.gptq_class().quantize)
    assert widened is not None
    code = inspect.unwrap(widened).__code__
    assert (code.co_filename, code.co_firstlineno) == (
        original.__code__.co_filename, original.__code__.co_firstlineno,
    )  # fmt: skip
    # what was compiled holds the widened condition (`in ("cuda", "cpu")`), gptqmodel's does not
    assert ("cuda", "cpu") in code.co_consts
    assert ("cuda", "cpu") not in original.__code__.co_consts
