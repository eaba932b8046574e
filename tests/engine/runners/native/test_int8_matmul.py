"""engine/runners/native/int8_matmul.c (the int8 lm_head) against the fp32 product of its own dequantized
weights and the bf16 weights it came from, for every instruction set this CPU runs (AVX2 forced
on an AVX-512 machine too), both activation kinds, odd shapes and row counts; as an lm_head
candidate; and the autotune's memory rule for copies."""

from __future__ import annotations

import shutil

import pytest
import torch

from predictor.engine.runners.kernels import autotune
from predictor.engine.runners.kernels.head_linear import head_candidates
from predictor.engine.runners.native import bindings as native
from tests.support import native_cache

ISAS = native.usable_isas()
needs_isa = pytest.mark.skipif(not ISAS, reason="this CPU has neither AVX2 + FMA nor AVX-512")
needs_compiler = pytest.mark.skipif(
    not any(shutil.which(cc) for cc in ("cc", "gcc", "g++", "clang")), reason="no C compiler"
)


def quantize(kernel: native.Int8Kernel, weight: torch.Tensor) -> torch.Tensor:
    n, k = weight.shape
    packed = torch.empty(kernel.nbytes(n, k), dtype=torch.uint8)
    kernel.quantize(weight.contiguous().data_ptr(), n, k, packed.data_ptr())
    return packed


def dequantized(kernel: native.Int8Kernel, packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    ids = torch.arange(n, dtype=torch.int64)
    out = torch.empty((n, k), dtype=torch.bfloat16)
    assert kernel.rows(packed.data_ptr(), n, k, ids.data_ptr(), n, out.data_ptr()) == 0
    return out


def run(kernel: native.Int8Kernel, packed: torch.Tensor, x: torch.Tensor, n: int, int8: int,
        threads: int = 1) -> torch.Tensor:  # fmt: skip
    rows, k = x.shape
    out = torch.full((rows, n + 5), 7.0)  # a wider stride: kept intact
    rc = kernel.matmul(x.data_ptr(), rows, k, packed.data_ptr(), n, out.data_ptr(), n + 5,
                       threads, int8)  # fmt: skip
    assert rc == 0
    assert torch.all(out[:, n:] == 7.0)
    return out[:, :n]


@needs_compiler
@needs_isa
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("n,k", [(16, 32), (37, 64), (200, 576), (1001, 96)])
def test_kernel_matches_its_dequantized_weights(isa: str, n: int, k: int) -> None:
    kernel = native.int8_matmul(isa, native_cache())
    generator = torch.Generator().manual_seed(n + k)
    weight = (torch.randn((n, k), generator=generator) * 0.05).bfloat16()
    packed = quantize(kernel, weight)
    dense = dequantized(kernel, packed, n, k).float()
    # Q8_0-like: per 32 inputs of a row, |w - d q| <= d / 2 with d ~ max|w| / 127 (the rows
    # read back in bf16: one more rounding of 2^-9 relative)
    blocks = weight.float().view(n, k // 32, 32)
    bound = blocks.abs().amax(-1, keepdim=True) / 127 * 0.51 + blocks.abs() / 256 + 1e-6
    assert torch.all((dense.view(n, k // 32, 32) - blocks).abs() <= bound)
    for rows in (1, 2, 3, 5, 8, 9, 16, 17, 33):
        x = torch.randn((rows, k), generator=generator).bfloat16()
        exact = x.float() @ dense.t()
        scale = float(exact.abs().max())
        f32 = run(kernel, packed, x, n, 0)  # d q exact in the kernel, bf16-rounded in `dense`
        assert float((f32 - exact).abs().max()) < 4e-3 * scale
        i8 = run(kernel, packed, x, n, 1)  # the activations rounded to int8 too
        assert float((i8 - exact).abs().max()) < 0.03 * scale
        assert float((i8 - exact).abs().mean()) < 0.005 * scale


@needs_compiler
@needs_isa
def test_every_instruction_set_makes_the_same_bytes_and_numbers_alike() -> None:
    weight = (torch.randn((100, 96)) * 0.1).bfloat16()
    packs = {isa: quantize(native.int8_matmul(isa, native_cache()), weight) for isa in ISAS}
    first = next(iter(packs.values()))
    assert all(torch.equal(p, first) for p in packs.values())
    x = torch.randn((6, 96)).bfloat16()
    outs = [run(native.int8_matmul(isa, native_cache()), first, x, 100, 0) for isa in ISAS]
    assert all(torch.allclose(o, outs[0], rtol=1e-5, atol=1e-5) for o in outs)


@needs_compiler
@needs_isa
def test_threads_split_the_tiles_with_the_same_numbers() -> None:
    kernel = native.int8_matmul(ISAS[0], native_cache())
    weight = (torch.randn((515, 128)) * 0.1).bfloat16()
    packed = quantize(kernel, weight)
    x = torch.randn((11, 128)).bfloat16()
    for int8 in (0, 1):
        assert torch.equal(
            run(kernel, packed, x, 515, int8, 1), run(kernel, packed, x, 515, int8, 2)
        )


@needs_compiler
@needs_isa
def test_bad_shapes_and_ids_are_refused() -> None:
    kernel = native.int8_matmul(ISAS[0], native_cache())
    packed = quantize(kernel, torch.ones((16, 64), dtype=torch.bfloat16))
    x = torch.ones((1, 48), dtype=torch.bfloat16)
    out = torch.empty((1, 16))
    assert kernel.matmul(x.data_ptr(), 1, 48, packed.data_ptr(), 16, out.data_ptr(), 16, 1, 1) == -2
    ids = torch.tensor([3, 16], dtype=torch.int64)
    rows = torch.empty((2, 64), dtype=torch.bfloat16)
    assert kernel.rows(packed.data_ptr(), 16, 64, ids.data_ptr(), 2, rows.data_ptr()) == -1


@needs_compiler
@needs_isa
def test_a_bf16_lm_head_gets_int8_candidates_that_pick_its_tokens() -> None:
    torch.manual_seed(0)
    head = torch.nn.Linear(64, 300, bias=False).bfloat16()
    found = head_candidates(head)
    names = [f"int8_i8_{ISAS[0]}", f"int8_f32_{ISAS[0]}"]
    assert set(names) <= set(found)
    x = torch.randn((9, 64)).bfloat16()
    reference = x.float() @ head.weight.float().t()
    for name in names:
        logits = found[name]()(x)
        assert logits.dtype == torch.float32 and logits.shape == (9, 300)
        assert float((logits - reference).abs().max()) < 0.05 * float(reference.abs().max())
        top2 = reference.topk(2, -1).values
        clear = (top2[:, 0] - top2[:, 1]) > 0.05 * float(reference.abs().max())
        assert torch.equal(logits.argmax(-1)[clear], reference.argmax(-1)[clear])
    fp32 = torch.nn.Linear(64, 300, bias=False)  # fp32 models keep their exact numbers
    assert set(head_candidates(fp32)) == {"module"}
    odd = torch.nn.Linear(48, 10, bias=False).bfloat16()  # k not a multiple of 32
    assert not any(name.startswith("int8_") for name in head_candidates(odd))


def test_a_copy_wins_only_by_the_margin_unless_a_smaller_bucket_holds_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # ms per kernel and row count: int8 (a copy) wins small buckets outright; prepacked (another
    # copy) is a little faster at 16+ rows but not by the margin over the held int8 copy, and
    # by more than the margin at 64
    figures = {
        "module": {1: 5.0, 2: 5.0, 4: 5.0, 8: 5.0, 16: 6.0, 32: 8.0, 64: 14.0},
        "int8_i8_x": {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.2, 16: 3.0, 32: 6.0, 64: 12.0},
        "prepacked_bf16": {1: 2.0, 2: 2.0, 4: 2.0, 8: 2.5, 16: 2.8, 32: 5.5, 64: 9.0},
    }
    kernels = {name: [lambda x: x] for name in figures}
    lookup = {id(layers): name for name, layers in kernels.items()}
    monkeypatch.setattr(
        autotune, "_time", lambda layers, x, _cut: figures[lookup[id(layers)]][x.shape[0]] / 1e3
    )
    plan, _ = autotune._buckets(kernels, 8, torch.Generator())
    assert plan == [(1, "int8_i8_x"), (64, "prepacked_bf16")]
