"""The GPU runner's Triton kernels against torch references (on the GPU, or under Triton's
interpreter on a CPU)."""

from __future__ import annotations

import pytest
import torch

from predictor.packing import dequantize

pytestmark = pytest.mark.cuda


def low(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """bf16 on the GPU; fp16 under the interpreter, which has no bf16 (numpy has none): the
    same kernels, the same rounding steps, in the 16-bit type it can run."""
    return torch.float16 if dtype == torch.bfloat16 and device.type == "cpu" else dtype


@pytest.fixture(scope="module")
def ops(kernel_device: torch.device):  # type: ignore[no-untyped-def]
    from predictor.engine.runners.cuda import triton_ops

    return triton_ops


def random_gptq(k: int, n: int, bits: int, group: int, device: torch.device):  # type: ignore[no-untyped-def]
    from predictor.model.gptq import pack_rows

    levels = 1 << bits
    codes = torch.randint(0, levels, (k, n), device=device)
    zeros = torch.randint(levels // 4, 3 * levels // 4, (k // group, n), device=device)
    scales = (torch.rand((k // group, n), device=device) + 0.5).to(torch.float16) * 0.01
    return pack_rows(codes, bits), codes, zeros.to(torch.uint8), scales


@pytest.mark.parametrize(
    ("m", "k", "n", "bits", "group", "dtype"),
    [
        (1, 256, 96, 4, 32, torch.bfloat16),
        (5, 128, 64, 4, 128, torch.bfloat16),
        (33, 192, 80, 8, 64, torch.bfloat16),
        (3, 128, 48, 4, 32, torch.float32),
    ],
)
def test_gptq_matmul_equals_the_dequantized_matmul(
    ops,
    m: int,
    k: int,
    n: int,
    bits: int,
    group: int,
    dtype: torch.dtype,  # type: ignore[no-untyped-def]
    kernel_device: torch.device,
) -> None:
    dtype = low(dtype, kernel_device)
    qweight, codes, zeros, scales = random_gptq(k, n, bits, group, kernel_device)
    x = torch.randn((m, k), device=kernel_device).to(dtype)
    g_idx = torch.arange(k, device=kernel_device) // group
    weight = dequantize(codes, zeros, scales, g_idx)  # exact in float32
    expected = x.double() @ weight.to(dtype).double()
    for block_m, block_n in ((16, 32), (32, 64)):
        got = ops.gptq_matmul(x, qweight, scales, zeros, bits, group, block_m, block_n)
        assert got.dtype == dtype and got.shape == (m, n)
        error = (got.double() - expected).norm() / expected.norm()
        assert error < (1e-2 if dtype != torch.float32 else 1e-6)


def reference_decode(q, pool, tables, lengths, heads, kv_heads, block_size, scale):  # type: ignore[no-untyped-def]
    out = []
    dim, group = pool.shape[2], heads // kv_heads
    for row in range(q.shape[0]):
        n = int(lengths[row])
        slots = torch.tensor(
            [int(tables[row, t // block_size]) * block_size + t % block_size for t in range(n)],
            device=pool.device,
        )
        keys, values = pool[:kv_heads, slots].double(), pool[kv_heads:, slots].double()
        query = q[row, : heads * dim].view(kv_heads, group, dim).double()
        probs = torch.softmax(query @ keys.transpose(1, 2) * scale, -1)
        out.append((probs @ values).reshape(heads * dim))
    return torch.stack(out)


@pytest.mark.parametrize(("heads", "kv_heads", "dim", "dtype"),
                         [(9, 3, 64, torch.bfloat16), (4, 4, 32, torch.float32)])  # fmt: skip
def test_paged_decode_attention_reads_rows_where_they_lie(
    ops,
    heads: int,
    kv_heads: int,
    dim: int,
    dtype: torch.dtype,
    kernel_device: torch.device,  # type: ignore[no-untyped-def]
) -> None:
    dtype = low(dtype, kernel_device)
    block_size, slots = 16, 40 * 16
    pool = torch.randn((2 * kv_heads, slots + 1, dim), device=kernel_device).to(dtype)
    lengths = torch.tensor([1, 17, 130, 64], dtype=torch.int32, device=kernel_device)
    order = torch.randperm(40, device=kernel_device).to(torch.int32)
    tables = order[:36].view(4, 9).contiguous()  # each row's blocks, scattered
    qkv = torch.randn((4, (heads + 2 * kv_heads) * dim), device=kernel_device).to(dtype)
    out = torch.full((4, heads * dim), float("nan"), dtype=dtype, device=kernel_device)
    scale = dim**-0.5
    ops.paged_decode_attention(qkv, pool, tables, lengths, out, heads, kv_heads, block_size, scale)
    expected = reference_decode(qkv, pool, tables, lengths, heads, kv_heads, block_size, scale)
    error = (out.double() - expected).norm() / expected.norm()
    assert error < (1e-2 if dtype != torch.float32 else 1e-5)
    padded = torch.zeros_like(lengths)  # a padding row attends to nothing: zeros, not NaN
    ops.paged_decode_attention(qkv, pool, tables, padded, out, heads, kv_heads, block_size, scale)
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_write_rotates_as_transformers_and_fills_the_slots(
    ops,
    dtype: torch.dtype,
    kernel_device: torch.device,  # type: ignore[no-untyped-def]
) -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    dtype = low(dtype, kernel_device)
    heads, kv_heads, dim, n = 4, 2, 32, 5
    positions = torch.tensor([0, 3, 7, 8, 100], device=kernel_device)
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, device=kernel_device).float() / dim))
    freqs = torch.arange(128, device=kernel_device).float()[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    qkv = torch.randn((n, (heads + 2 * kv_heads) * dim), device=kernel_device).to(dtype)
    pool = torch.zeros((2 * kv_heads, 64, dim), dtype=dtype, device=kernel_device)
    slots = torch.tensor([5, 9, -1, 0, 63], dtype=torch.int32, device=kernel_device)
    view = qkv.view(n, heads + 2 * kv_heads, dim)
    q, k, v = (
        view[:, :heads].clone(),
        view[:, heads : heads + kv_heads].clone(),
        view[:, heads + kv_heads :].clone(),
    )
    q_ref, k_ref = apply_rotary_pos_emb(
        q.transpose(0, 1), k.transpose(0, 1), cos[positions], sin[positions], unsqueeze_dim=0
    )
    ops.rope_write(qkv, cos, sin, positions.to(torch.int32), slots, pool, heads, kv_heads)
    tolerance = {} if dtype != torch.float32 else {"rtol": 1e-6, "atol": 1e-6}
    torch.testing.assert_close(view[:, :heads], q_ref.transpose(0, 1), **tolerance)
    torch.testing.assert_close(
        view[:, heads : heads + kv_heads], k_ref.transpose(0, 1), **tolerance
    )
    assert torch.equal(view[:, heads + kv_heads :], v)  # v passes through
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(pool[:kv_heads, slot], view[row, heads : heads + kv_heads])
            assert torch.equal(pool[kv_heads:, slot], v[row])
    written = set(s for s in slots.tolist() if s >= 0)
    untouched = [s for s in range(64) if s not in written]
    assert not pool[:, untouched].any()  # a -1 slot wrote nothing


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_add_rms_norm_rounds_as_transformers(
    ops, dtype: torch.dtype, kernel_device: torch.device
) -> None:  # type: ignore[no-untyped-def]
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    dtype = low(dtype, kernel_device)
    norm = LlamaRMSNorm(576, eps=1e-5).to(kernel_device, dtype)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.1)
    hidden = torch.randn((7, 576), device=kernel_device).to(dtype)
    delta = torch.randn((7, 576), device=kernel_device).to(dtype)
    expected_hidden = hidden + delta
    with torch.no_grad():
        expected = norm(expected_hidden)
    got = ops.add_rms_norm(hidden, delta, norm.weight.detach(), 1e-5)
    assert torch.equal(hidden, expected_hidden)  # the residual, updated in place
    tolerance = {"rtol": 1e-6, "atol": 1e-6}
    if dtype != torch.float32:  # a sum's order may move a rounding now and then
        assert (got != expected).float().mean() < 0.01
    torch.testing.assert_close(got, expected, **({} if dtype != torch.float32 else tolerance))
    alone = ops.add_rms_norm(hidden.clone(), None, norm.weight.detach(), 1e-5)
    torch.testing.assert_close(alone, got, rtol=0, atol=0)


def test_silu_mul_rounds_as_transformers(ops, kernel_device: torch.device) -> None:  # type: ignore[no-untyped-def]
    gate_up = torch.randn((3, 2 * 1536), device=kernel_device).to(
        low(torch.bfloat16, kernel_device)
    )
    gate, up = gate_up[:, :1536], gate_up[:, 1536:]
    expected = torch.nn.functional.silu(gate) * up
    got = ops.silu_mul(gate_up)
    assert (got != expected).float().mean() < 0.01
    torch.testing.assert_close(got, expected)
