"""Contract tests: one per item of predictor/engine/runners/internals.py, calling each private
torch op as the runners do, so a torch upgrade that changes one fails here, naming it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from predictor.engine.runners import internals
from predictor.model.loader import load_checkpoint


def int4_weights(n: int = 32, k: int = 64, group: int = 32) -> tuple[torch.Tensor, ...]:
    """Codes, their int4pack packing, scales-and-zeros and the fp32 weights they stand for."""
    torch.manual_seed(0)
    codes = torch.randint(0, 16, (n, k), dtype=torch.int32)
    scales = torch.rand(k // group, n) * 0.1 + 0.01
    zeros = torch.randn(k // group, n) * 0.1
    scales_and_zeros = torch.stack([scales, zeros], dim=-1).to(torch.bfloat16)
    # int4pack's dequantization: (code - 8) * scale + zero, per group of inputs
    s = scales_and_zeros[..., 0].float().repeat_interleave(group, 0).t()
    z = scales_and_zeros[..., 1].float().repeat_interleave(group, 0).t()
    dense = (codes.float() - 8) * s + z
    return codes, internals.convert_to_int4pack(codes), scales_and_zeros, dense


def test_every_item_has_a_contract_test() -> None:
    names = {n for n in globals() if n.startswith("test_item_")}
    assert {f"test_item_{i.lower()}" for i in internals.ITEMS} == names


def test_item_int4pack_mm() -> None:
    _, packed, scales_and_zeros, dense = int4_weights()
    x = torch.randn(3, 64).to(torch.bfloat16)
    out = internals.int4pack_mm(x, packed, 32, scales_and_zeros)
    assert out.shape == (3, 32) and out.dtype == torch.bfloat16
    expected = x.float() @ dense.t()
    assert torch.allclose(out.float(), expected, atol=0.05, rtol=0.02), "INT4PACK_MM changed"


def test_item_int4pack_convert() -> None:
    codes, packed, _, _ = int4_weights()
    assert packed.dtype == torch.uint8 and packed.numel() * 2 == codes.numel(), "INT4PACK_CONVERT"


def test_item_onednn_prepack() -> None:
    if not internals.onednn_prepack_available():
        pytest.skip("this torch build has no oneDNN prepacked linear (the runners fall back)")
    weight = torch.randn(48, 64).to(torch.bfloat16)
    x = torch.randn(5, 64).to(torch.bfloat16)
    try:
        prepacked = internals.onednn_reorder(weight, 16)
    except RuntimeError as exc:  # a CPU oneDNN refuses for bf16 (AVX2 only): the runners skip it
        pytest.skip(f"oneDNN refuses bf16 prepacking on this CPU: {exc}")
    out = internals.onednn_linear(x, prepacked)
    assert torch.allclose(out.float(), x.float() @ weight.float().t(), atol=0.1), "ONEDNN_PREPACK"


@pytest.mark.cuda
def test_item_int4pack_cuda() -> None:
    """tinygemm as cuda/linear.py calls it (two codes a byte, the even input high), against the
    weights it stands for; runs on the GPU machine (its own torch), skipped elsewhere."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    codes, _, scales_and_zeros, dense = int4_weights(n=64, k=256, group=64)
    packed = ((codes[:, ::2] << 4) | codes[:, 1::2]).to(torch.uint8).cuda()
    weight = internals.convert_to_int4pack_cuda(packed, 8)
    x = torch.randn(5, 256).to(torch.bfloat16).cuda()
    out = internals.int4pack_mm_cuda(x, weight, 64, scales_and_zeros.cuda())
    assert out.shape == (5, 64) and out.dtype == torch.bfloat16, "INT4PACK_CUDA changed"
    expected = x.float() @ dense.cuda().t()
    error = (out.float() - expected).norm() / expected.norm()
    assert error < 2e-2, "INT4PACK_CUDA changed its layout or dequantization"


def test_item_gptqmodel_aten(tiny_gptq_dir: Path) -> None:
    """The runner's two views of a TorchAtenLinear: GPTQ's tensors as loaded, and once the
    module has packed itself for the CPU its int4pack weights and scales-and-zeros; both
    compute what the module's own forward does, through INT4PACK_MM."""
    from predictor.engine.runners.kernels.int4_codes import gptq_codes

    fresh = load_checkpoint(tiny_gptq_dir, device="cpu")  # no forward has packed it yet
    q_proj = fresh.model.model.layers[0].self_attn.q_proj
    loaded = internals.aten_packed(q_proj)
    assert isinstance(loaded, internals.AtenPacked), loaded
    n, k = loaded.out_features, loaded.in_features
    assert not loaded.int4pack and loaded.qweight.shape == (k // 8, n), "GPTQMODEL_ATEN as loaded"
    assert loaded.scales_and_zeros.shape == (k // loaded.group_size, n, 2)
    assert loaded.order.shape == (k,) and loaded.bias is None
    from_loaded = internals.convert_to_int4pack(gptq_codes(loaded).int())
    x = torch.randn(3, k).to(torch.bfloat16)
    with torch.inference_mode():
        theirs = q_proj(x)  # packs the module (transform("cpu"))
    packed = internals.aten_packed(q_proj)
    assert isinstance(packed, internals.AtenPacked), packed
    assert packed.int4pack and packed.qweight.dtype == torch.uint8
    assert packed.qweight.shape == (n, k // 2), "GPTQMODEL_ATEN packed"
    assert torch.equal(packed.scales_and_zeros, loaded.scales_and_zeros), "zero offsets changed"
    assert torch.equal(packed.order.long(), loaded.order), "act-order's input order changed"
    for weights in (packed.qweight, from_loaded):
        ours = internals.int4pack_mm(x, weights, packed.group_size, packed.scales_and_zeros)
        assert torch.allclose(ours.float(), theirs.float(), atol=1e-2, rtol=1e-2), "GPTQMODEL_ATEN"
    # and what it refuses, with its reason
    assert "not gptqmodel's TorchAtenLinear" in str(internals.aten_packed(torch.nn.Linear(4, 4)))
