"""engine/runners/native/int4_matmul.c against torch's int4 op and the fp32 dequantized weights, for every
instruction set this CPU runs (AVX2 forced on an AVX-512 machine too), both activation kinds,
edge shapes and odd row counts; and the Int4Linear kernels on the tiny model's layers."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from predictor.engine.runners.kernels.int4_codes import (
    _int4pack_block,
    int4pack_codes,
    repack_codes,
)
from predictor.engine.runners.kernels.int4_linear import Int4Linear
from predictor.engine.runners.native import bindings as native
from tests.support import native_cache

ISAS = native.usable_isas()
needs_isa = pytest.mark.skipif(not ISAS, reason="this CPU has neither AVX2 + FMA nor AVX-512")
needs_compiler = pytest.mark.skipif(
    not any(__import__("shutil").which(cc) for cc in ("cc", "gcc", "g++", "clang")),
    reason="no C compiler",
)


def quantized(n: int, k: int, group: int, seed: int) -> dict[str, torch.Tensor]:
    """Random codes, scales and zeros; torch's int4pack of them (None: torch packs only n a
    multiple of 16); the fp32 dequantized weights."""
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=generator)
    scales = (torch.rand((k // group, n), generator=generator) * 0.02 + 0.002).bfloat16()
    zeros = (torch.randn((k // group, n), generator=generator) * 0.05).bfloat16()
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1) if n % 16 == 0 else None
    scales_and_zeros = torch.stack((scales, zeros), dim=-1).contiguous()  # [groups, n, 2]
    expand = lambda t: t.float().repeat_interleave(group, 0).t()  # noqa: E731 [n, k]
    dense = expand(scales) * (codes.float() - 8) + expand(zeros)  # torch's int4pack convention
    return {"codes": codes, "packed": packed, "sz": scales_and_zeros, "dense": dense,
            "scales": scales, "zeros": zeros}  # fmt: skip


def repacked(kernel: native.Int4Kernel, q: dict, n: int, k: int, group: int) -> torch.Tensor:
    """The kernel's layout straight from the codes (any n), as int4_codes.repack_codes makes it
    (from torch's int4pack too: the same bytes)."""
    weight = torch.empty(native.Int4Kernel.packed_bytes(n, k, group), dtype=torch.uint8)
    codes = q["codes"].to(torch.uint8).contiguous()
    kernel.repack(codes.data_ptr(), q["scales"].contiguous().data_ptr(),
                  q["zeros"].contiguous().data_ptr(), n, k, group, weight.data_ptr())  # fmt: skip
    if q["packed"] is not None:  # from torch's int4pack: the same bytes
        codes = int4pack_codes(q["packed"], n, k)
        assert torch.equal(repack_codes(kernel, codes, q["sz"], group, k), weight)
    return weight


def run_kernel(
    kernel: native.Int4Kernel, weight: torch.Tensor, x: torch.Tensor, n: int, group: int, int8: int
) -> torch.Tensor:
    rows, k = x.shape
    out = torch.full((rows, n + 3), 7.0, dtype=torch.bfloat16)  # a wider stride: kept intact
    rc = kernel.matmul(x.data_ptr(), rows, k, weight.data_ptr(), n, group, out.data_ptr(), n + 3,
                       1, int8)  # fmt: skip
    assert rc == 0
    assert torch.all(out[:, n:] == 7.0)  # nothing written past the n columns
    return out[:, :n]


def test_int4pack_codes_reads_torchs_layout_back() -> None:
    """By a permute where rows come in whole blocks (64 under AVX-512, 32 under AVX2: the fast
    path is in use on either), else through the position table."""
    assert _int4pack_block() in (64, 32)
    for n, k in ((16, 32), (48, 96), (960, 576), (64, 128)):
        q = quantized(n, k, 32, seed=n)
        assert torch.equal(int4pack_codes(q["packed"], n, k).int(), q["codes"])


@needs_compiler
@needs_isa
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("n,k,group", [(16, 32, 32), (40, 96, 32), (208, 576, 32), (72, 128, 64)])
def test_kernel_matches_the_int4_op_and_fp32_weights(isa: str, n: int, k: int, group: int) -> None:
    kernel = native.int4_matmul(isa, native_cache())
    q = quantized(n, k, group, seed=n + k)
    weight = repacked(kernel, q, n, k, group)
    generator = torch.Generator().manual_seed(1)
    for rows in (1, 2, 3, 5, 8, 9, 16, 17, 33):
        x = torch.randn((rows, k), generator=generator).bfloat16()
        exact = x.float() @ q["dense"].t()  # [rows, n] fp32
        scale = float(exact.abs().max())
        f32 = run_kernel(kernel, weight, x, n, group, 0).float()
        # fp32 sums, one bf16 rounding: as close to the exact product as torch's op is
        assert (f32 - exact).abs().max() <= 0.01 * scale, (isa, rows)
        if q["packed"] is not None:
            op = torch.ops.aten._weight_int4pack_mm_for_cpu(x, q["packed"], group, q["sz"])
            assert (f32 - op.float()).abs().max() <= 0.01 * scale, (isa, rows)
        i8 = run_kernel(kernel, weight, x, n, group, 1).float()
        # int8 activations (32 inputs a scale): llama.cpp's Q8 error, about 1% of the range
        assert (i8 - exact).abs().max() <= 0.03 * scale, (isa, rows)
        assert torch.corrcoef(torch.stack((i8.flatten(), exact.flatten())))[0, 1] > 0.999


def quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the i8 kernel reads it, in fp32: per 32 inputs q = round(x / d), d = max|x| / 127."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    q = torch.round(blocks / torch.where(d > 0, d, torch.ones_like(d)))
    return (q * d).reshape(x.shape)


@needs_compiler
@needs_isa
@pytest.mark.parametrize("isa", ISAS)
def test_int8_activations_lose_only_their_rounding(isa: str) -> None:
    """The i8 kernel's product is the weights times x as quantized, to fp32 and bf16 rounding:
    its error is the activations' rounding, weighed by the weights, nothing more. (It once
    added m * sum(x) for the zero offsets, with x unquantized, so the rounding was weighed by
    the 0..15 codes instead: twice the error, 3% of SmolLM2's served perplexity.)"""
    n, k, group = 208, 576, 32
    kernel = native.int4_matmul(isa, native_cache())
    q = quantized(n, k, group, seed=5)
    weight = repacked(kernel, q, n, k, group)
    generator = torch.Generator().manual_seed(2)
    x = torch.randn((9, k), generator=generator)
    x[:, ::37] *= 20  # a few outlier channels, as a norm's weights make them
    x = x.bfloat16()
    exact = x.float() @ q["dense"].t()
    as_read = quantized_activations(x) @ q["dense"].t()
    i8 = run_kernel(kernel, weight, x, n, group, 1).float()
    rounding = float((as_read - exact).norm())
    assert float((i8 - as_read).norm()) < 0.5 * rounding, isa


@needs_compiler
@needs_isa
def test_int8_activations_need_groups_of_32() -> None:
    kernel = native.int4_matmul(ISAS[0], native_cache())
    q = quantized(16, 48, 16, seed=3)
    weight = repacked(kernel, q, 16, 48, 16)
    x = torch.randn((2, 48)).bfloat16()
    out = torch.empty((2, 16), dtype=torch.bfloat16)
    assert (
        kernel.matmul(x.data_ptr(), 2, 48, weight.data_ptr(), 16, 16, out.data_ptr(), 16, 1, 1) < 0
    )
    f32 = run_kernel(kernel, weight, x, 16, 16, 0).float()  # the f32 kernel takes groups of 16
    assert torch.allclose(f32, x.float() @ q["dense"].t(), atol=0.01 * float(f32.abs().max()))


@needs_compiler
@needs_isa
def test_threads_split_the_tiles_with_the_same_numbers() -> None:
    kernel = native.int4_matmul(ISAS[0], native_cache())
    n, k = 512, 256
    q = quantized(n, k, 32, seed=9)
    weight = repacked(kernel, q, n, k, 32)
    x = torch.randn((7, k)).bfloat16()
    for int8 in (0, 1):
        one = torch.empty((7, n), dtype=torch.bfloat16)
        two = torch.empty((7, n), dtype=torch.bfloat16)
        for out, threads in ((one, 1), (two, 2)):
            rc = kernel.matmul(x.data_ptr(), 7, k, weight.data_ptr(), n, 32, out.data_ptr(), n,
                               threads, int8)  # fmt: skip
            assert rc == 0
        assert torch.equal(one, two)  # each output column is one thread's: same sums


def fused_layers(tiny_gptq: Any) -> list[Int4Linear]:
    from predictor.engine.runners.kernels.int4_linear import FusedLayer, fuse_layer

    fused = fuse_layer(tiny_gptq.model.model.layers[0])
    assert isinstance(fused, FusedLayer), fused
    return [fused.qkv, fused.o, fused.gate_up, fused.down]


@needs_compiler
def test_every_candidate_kernel_of_a_fused_layer_agrees_with_the_int4_op(tiny_gptq: Any) -> None:
    for layer in fused_layers(tiny_gptq):
        names = layer.candidates(every_isa=True)
        assert names[0] == "int4_op"
        if ISAS:
            assert f"native_f32_{ISAS[-1]}" in names and f"native_i8_{ISAS[0]}" in names
        for rows in (1, 3, 16, 37):
            x = torch.randn((rows, layer.in_features)).bfloat16()
            reference = layer.kernel("int4_op")(x).float()
            scale = float(reference.abs().max())
            for name in names:
                got = layer.kernel(name)(x)
                assert got.shape == (rows, layer.out_features) and got.dtype == torch.bfloat16
                tolerance = 0.04 if "_i8_" in name else 0.015
                assert (got.float() - reference).abs().max() <= tolerance * scale, (name, rows)


@needs_compiler
@needs_isa
def test_a_plan_serves_each_row_count_by_its_bucket(tiny_gptq: Any) -> None:
    layer = fused_layers(tiny_gptq)[2]
    calls: list[str] = []

    def counted(name: str) -> Any:
        kernel = layer.kernel(name)
        return lambda x: calls.append(name) or kernel(x)

    wide = f"native_f32_{ISAS[0]}"
    layer._kernels.update({name: counted(name) for name in ("int4_op", wide)})
    layer.use([(1, "native_f32"), (4, "int4_op")])
    x = torch.randn((1, layer.in_features)).bfloat16()
    for rows in (1, 3, 4, 40):
        layer(x.expand(rows, -1).contiguous())
    assert calls == [wide] * 2 + ["int4_op"] * 2
    with pytest.raises(ValueError, match="1 row"):
        layer.use([(2, "int4_op")])
    layer.use([(1, "int4_op")])
    assert layer._native_weight is None  # no native kernel chosen: its repacked bytes dropped


def test_an_instruction_set_this_cpu_lacks_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    monkeypatch.setattr(native, "_INT4", {})
    assert native.usable_isas() == ["avx2"]
    with pytest.raises(native.NativeUnavailable, match="lacks avx512"):
        native.int4_matmul("avx512")
    with pytest.raises(native.NativeUnavailable, match="unknown instruction set"):
        native.int4_matmul("neon")
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset())
    assert native.usable_isas() == []


def test_without_a_compiler_the_int4_kernel_is_unavailable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setattr(native, "_INT4", {})
    for isa in ISAS:
        with pytest.raises(native.NativeUnavailable, match="no C compiler"):
            native.int4_matmul(isa)


@needs_compiler
@needs_isa
def test_the_compiled_library_is_cached_and_reused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    monkeypatch.setattr(native, "_INT4", {})
    first = native.int4_matmul(ISAS[-1], tmp_path)
    assert len(list(tmp_path.glob("int4_matmul-*.so"))) == 1
    monkeypatch.setattr(native, "_INT4", {})

    def no_build(*args: Any, **kwargs: Any) -> None:
        raise OSError("no temporary folder")

    monkeypatch.setattr("tempfile.TemporaryDirectory", no_build)  # only a cache hit succeeds
    again = native.int4_matmul(ISAS[-1], tmp_path)
    assert again.isa == first.isa and again.width == first.width


@pytest.mark.parametrize(("n", "k", "group"), [(64, 128, 32), (96, 256, 128), (48, 64, 64)])
def test_dequantized_int4pack_is_what_the_int4_op_computes(n: int, k: int, group: int) -> None:
    """The bf16 expansion the prepacked kernel serves (the codes read back from int4pack,
    expanded) equals, bit for bit, the int4 op applied to an identity matrix (what it was
    computed by before: K^2 N multiply-adds)."""
    from predictor.engine.runners import internals
    from predictor.engine.runners.kernels.int4_codes import dequantize_codes

    generator = torch.Generator().manual_seed(n)
    codes = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=generator)
    packed = internals.convert_to_int4pack(codes)
    scales = torch.rand((k // group, n), generator=generator) * 0.1
    zeros = torch.randn((k // group, n), generator=generator) * 0.1
    scales_and_zeros = torch.stack((scales, zeros), -1).to(torch.bfloat16)
    eye = torch.eye(k, dtype=torch.bfloat16)
    expected = internals.int4pack_mm(eye, packed, group, scales_and_zeros).t()
    dense = dequantize_codes(int4pack_codes(packed, n, k), scales_and_zeros, group)
    assert torch.equal(dense, expected)


def test_gptq_words_unpack_alike_in_c_and_in_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """GPTQ's int32 words [K / 8, N] as codes [N, K], inputs in act-order's order: the C
    helper (int4_matmul.c's gptq_unpack4) and torch's fallback agree with the words' meaning."""
    from predictor.engine.runners import internals
    from predictor.engine.runners.kernels import int4_codes

    n, k = 48, 64
    codes = torch.randint(0, 16, (k, n), dtype=torch.int64)  # [input][column]
    words = torch.zeros((k // 8, n), dtype=torch.int64)
    for j in range(8):
        words |= codes[j::8] << (4 * j)
    qweight = ((words + 2**31) % 2**32 - 2**31).to(torch.int32)  # the words' bits, signed
    order = torch.randperm(k)
    part = internals.AtenPacked(
        qweight=qweight, int4pack=False, scales_and_zeros=torch.zeros((2, n, 2)), order=order,
        bias=None, group_size=32, in_features=k, out_features=n,
    )  # fmt: skip
    expected = codes[order].t().to(torch.uint8)
    if native.usable_isas():
        assert torch.equal(int4_codes.gptq_codes(part), expected), "C unpack"
    monkeypatch.setattr(int4_codes, "load_helpers", lambda: None)
    assert torch.equal(int4_codes.gptq_codes(part), expected), "torch unpack"
