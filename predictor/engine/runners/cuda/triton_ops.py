"""The GPU runner's Triton kernels, each with a small wrapper over tensors.

- `gptq_matmul`: x [M, K] @ the GPTQ weight [K, N] dequantized in the kernel (4 or 8 bits,
  contiguous groups: act-order rows are reordered at load). Each code becomes
  scale * (code - zero) in float32, exactly as the dequantized reference computes it, then the
  activations' dtype for the tensor cores; float32 accumulation.
- `paged_decode_attention`: one query per row against its keys and values where they lie in
  the paged cache (block tables and lengths on the device, so a CUDA graph replays it for any
  lengths); the query heads that share a kv head are one tile (GQA); online softmax in float32.
- `rope_write`: q and k rotated in place and k, v written to their cache slots, one launch.
- `add_rms_norm`: the residual add fused into the next RMSNorm, rounding as transformers' Llama
  code does (the add in the model's dtype, the norm in float32, its output rounded before the
  weight multiplies it).
- `silu_mul`: SwiGLU's silu(gate) * up, rounded as transformers' two ops round.

Triton is imported only here, and only the GPU runner imports this module. Under
TRITON_INTERPRET=1 the kernels run on the CPU (numpy), which the tests use where no GPU is.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gptq_matmul_kernel(
    x_ptr,
    qweight_ptr,
    scales_ptr,
    zeros_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_om,
    group_size,
    BITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    PER: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        a = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :], mask=m_ok[:, None], other=0.0)
        words = tl.load(
            qweight_ptr + (k // PER)[:, None] * N + rn[None, :], mask=n_ok[None, :], other=0
        )
        codes = (words >> ((k % PER) * BITS)[:, None]) & MASK  # [BLOCK_K, BLOCK_N]
        g = k0 // group_size  # BLOCK_K divides the group size: one group per step
        scale = tl.load(scales_ptr + g * N + rn, mask=n_ok, other=0.0).to(tl.float32)
        zero = tl.load(zeros_ptr + g * N + rn, mask=n_ok, other=0).to(tl.int32)
        w = ((codes - zero[None, :]).to(tl.float32) * scale[None, :]).to(a.dtype)
        if IEEE:
            acc += tl.dot(a, w, input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    tl.store(
        out_ptr + rm[:, None] * stride_om + rn[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=m_ok[:, None] & n_ok[None, :],
    )


def gptq_block_k(group_size: int, in_features: int) -> int:
    """The K step: the largest of 128, 64, 32 dividing both the group and the input width."""
    for block in (128, 64, 32):
        if group_size % block == 0 and in_features % block == 0:
            return block
    raise ValueError(f"group size {group_size} and width {in_features} share no step of 32+")


def gptq_matmul(
    x: torch.Tensor,  # [M, K], rows contiguous
    qweight: torch.Tensor,  # [K * bits / 32, N] int32
    scales: torch.Tensor,  # [K / group, N]
    zeros: torch.Tensor,  # [K / group, N] uint8
    bits: int,
    group_size: int,
    block_m: int,
    block_n: int,
    warps: int = 4,
) -> torch.Tensor:
    m, k = x.shape
    n = qweight.shape[1]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_k = min(gptq_block_k(group_size, k), 64 if block_m <= 16 else 32)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _gptq_matmul_kernel[grid](
        x,
        qweight,
        scales,
        zeros,
        out,
        m,
        n,
        k,
        x.stride(0),
        out.stride(0),
        group_size,
        BITS=bits,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        IEEE=x.dtype == torch.float32,
        num_warps=warps,
    )
    return out


@triton.jit
def _paged_decode_kernel(
    q_ptr,
    stride_q,
    pool_ptr,
    stride_head,
    tables_ptr,
    stride_table,
    lengths_ptr,
    out_ptr,
    stride_out,
    scale,
    KV_HEADS,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    IEEE: tl.constexpr,
):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    length = tl.load(lengths_ptr + row)
    lanes = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + lanes
    head_ok = lanes < GROUP
    d = tl.arange(0, DIM)
    q = tl.load(
        q_ptr + row * stride_q + heads[:, None] * DIM + d[None, :], mask=head_ok[:, None], other=0.0
    )
    m_i = tl.full((GROUP_PAD,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((GROUP_PAD,), dtype=tl.float32)
    acc = tl.zeros((GROUP_PAD, DIM), dtype=tl.float32)
    keys = pool_ptr + kv_head * stride_head
    values = pool_ptr + (KV_HEADS + kv_head) * stride_head
    for t0 in range(0, length, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        t_ok = t < length
        block = tl.load(tables_ptr + row * stride_table + t // BLOCK_SIZE, mask=t_ok, other=0)
        slot = block.to(tl.int64) * BLOCK_SIZE + t % BLOCK_SIZE
        k = tl.load(keys + slot[:, None] * DIM + d[None, :], mask=t_ok[:, None], other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [GROUP_PAD, BLOCK_T]
        else:
            s = tl.dot(q, tl.trans(k)).to(tl.float32) * scale
        s = tl.where(t_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(values + slot[:, None] * DIM + d[None, :], mask=t_ok[:, None], other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
        m_i = m_new
    l_i = tl.where(l_i == 0.0, 1.0, l_i)  # a padding row (length 0) attends to nothing: zeros
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + row * stride_out + heads[:, None] * DIM + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=head_ok[:, None],
    )


def paged_decode_attention(
    qkv: torch.Tensor,  # [B, >= heads * dim]: each row's query heads first
    pool: torch.Tensor,  # [2 kv_heads, slots, dim]: keys then values
    tables: torch.Tensor,  # [B, blocks] int32
    lengths: torch.Tensor,  # [B] int32: keys to attend (0: a padding row)
    out: torch.Tensor,  # [B, heads * dim]
    heads: int,
    kv_heads: int,
    block_size: int,
    scale: float,
) -> None:
    rows, dim = tables.shape[0], pool.shape[2]
    group = heads // kv_heads
    _paged_decode_kernel[(rows, kv_heads)](
        qkv,
        qkv.stride(0),
        pool,
        pool.stride(0),
        tables,
        tables.stride(0),
        lengths,
        out,
        out.stride(0),
        scale,
        kv_heads,
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        DIM=dim,
        BLOCK_SIZE=block_size,
        BLOCK_T=64,
        IEEE=pool.dtype == torch.float32,
        num_warps=4,
    )


@triton.jit
def _rope_write_kernel(
    qkv_ptr,
    stride_qkv,
    cos_ptr,
    sin_ptr,
    positions_ptr,
    slots_ptr,
    pool_ptr,
    stride_head,
    HEADS,
    KV_HEADS,
    DIM: tl.constexpr,
    HALF: tl.constexpr,
    F32: tl.constexpr,
):
    n = tl.program_id(0)
    head = tl.program_id(1)  # q heads, then k heads, then v heads
    base = qkv_ptr + n * stride_qkv + head * DIM
    i = tl.arange(0, HALF)
    slot = tl.load(slots_ptr + n).to(tl.int64)
    if head < HEADS + KV_HEADS:
        pos = tl.load(positions_ptr + n).to(tl.int64)
        x1 = tl.load(base + i)
        x2 = tl.load(base + HALF + i)
        c1 = tl.load(cos_ptr + pos * DIM + i)
        c2 = tl.load(cos_ptr + pos * DIM + HALF + i)
        s1 = tl.load(sin_ptr + pos * DIM + i)
        s2 = tl.load(sin_ptr + pos * DIM + HALF + i)
        dtype = x1.dtype
        if F32:
            y1 = x1 * c1 - x2 * s1
            y2 = x2 * c2 + x1 * s2
        else:  # x * cos + rotate_half(x) * sin, each product and the sum rounded (transformers)
            y1 = ((x1 * c1).to(dtype) + (-x2 * s1).to(dtype)).to(dtype)
            y2 = ((x2 * c2).to(dtype) + (x1 * s2).to(dtype)).to(dtype)
        tl.store(base + i, y1)
        tl.store(base + HALF + i, y2)
        if head >= HEADS and slot >= 0:
            target = pool_ptr + (head - HEADS) * stride_head + slot * DIM
            tl.store(target + i, y1)
            tl.store(target + HALF + i, y2)
    elif slot >= 0:
        target = pool_ptr + (head - HEADS) * stride_head + slot * DIM
        tl.store(target + i, tl.load(base + i))
        tl.store(target + HALF + i, tl.load(base + HALF + i))


def rope_write(
    qkv: torch.Tensor,  # [N, (heads + 2 kv_heads) * dim], rows contiguous
    cos: torch.Tensor,  # [positions, dim] in qkv's dtype
    sin: torch.Tensor,
    positions: torch.Tensor,  # [N] int32
    slots: torch.Tensor,  # [N] int32; -1: write nothing (a padding row)
    pool: torch.Tensor,  # [2 kv_heads, slots, dim]
    heads: int,
    kv_heads: int,
) -> None:
    n, dim = qkv.shape[0], pool.shape[2]
    _rope_write_kernel[(n, heads + 2 * kv_heads)](
        qkv,
        qkv.stride(0),
        cos,
        sin,
        positions,
        slots,
        pool,
        pool.stride(0),
        heads,
        kv_heads,
        DIM=dim,
        HALF=dim // 2,
        F32=qkv.dtype == torch.float32,
        num_warps=1,
    )


@triton.jit
def _add_rms_norm_kernel(
    hidden_ptr,
    delta_ptr,
    weight_ptr,
    out_ptr,
    width,
    eps,
    HAS_DELTA: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    i = tl.arange(0, BLOCK)
    ok = i < width
    h = tl.load(hidden_ptr + row * width + i, mask=ok, other=0.0)
    if HAS_DELTA:
        h = (h + tl.load(delta_ptr + row * width + i, mask=ok, other=0.0)).to(h.dtype)
        tl.store(hidden_ptr + row * width + i, h, mask=ok)
    x = h.to(tl.float32)
    variance = tl.sum(x * x, 0) / width
    normed = (x * tl.math.rsqrt(variance + eps)).to(h.dtype)
    w = tl.load(weight_ptr + i, mask=ok, other=0.0)
    tl.store(out_ptr + row * width + i, (w * normed).to(h.dtype), mask=ok)


def add_rms_norm(
    hidden: torch.Tensor,  # [N, width], contiguous; hidden += delta in place
    delta: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    out = torch.empty_like(hidden)
    rows, width = hidden.shape
    block = triton.next_power_of_2(width)
    _add_rms_norm_kernel[(rows,)](
        hidden,
        hidden if delta is None else delta,
        weight,
        out,
        width,
        eps,
        HAS_DELTA=delta is not None,
        BLOCK=block,
        num_warps=min(16, max(1, block // 256)),
    )
    return out


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, inner, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = i < inner
    gate = tl.load(gate_up_ptr + row * 2 * inner + i, mask=ok, other=0.0)
    up = tl.load(gate_up_ptr + row * 2 * inner + inner + i, mask=ok, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    tl.store(out_ptr + row * inner + i, (act * up).to(gate.dtype), mask=ok)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[N, 2 inner] (gate first, contiguous) -> [N, inner]."""
    rows, inner = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, inner), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(inner))
    _silu_mul_kernel[(rows, triton.cdiv(inner, block))](gate_up, out, inner, BLOCK=block)
    return out
