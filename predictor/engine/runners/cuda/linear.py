"""The GPU runner's GPTQ projections: a layer's q, k and v (gate and up) side by side as one
weight, served per step by the kernel the autotune measured fastest for its row count.

The kernels (`KERNELS`):
- `tinygemm`: torch's own int4 matmul (`_weight_int4pack_mm`, bf16 activations, 4 bits,
  groups of 32 to 256), the codes repacked once into its tiled layout; its zero point is a
  float per group: scale * (8 - zero), rounded to bf16 with the scale.
- `triton_MxN`: triton_ops.gptq_matmul over the checkpoint's own packing (4 or 8 bits, any
  group of 32+, float32 dequantization exactly as the reference does), in tiles of M rows x N
  columns.
- `dense`: the weight dequantized once to the activations' dtype, torch's dense matmul (cuBLAS):
  4x the memory of the 4-bit weight (for 4 bits), kept only where a bucket chose it.
Marlin (vLLM's, gptqmodel's) is a compiled extension this runner does not carry.

Act-order checkpoints arrive with their rows reordered (model/gptq.py): the input is gathered by
`perm` once per call (q, k and v share it: their quantization order is the same Hessian's).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from predictor.engine.runners import internals
from predictor.packing import dequantize, unpack_rows

Kernel = Callable[[torch.Tensor], torch.Tensor]  # [M, K] -> [M, N], the activations' dtype
TINYGEMM, DENSE = "tinygemm", "dense"
# Triton tiles (rows x columns) offered per row count: small tiles for few rows (more
# programs over the columns: a decode step must keep every multiprocessor reading), wide ones
# for prompt chunks
TRITON_TILES = {
    1: ((16, 32), (16, 64)),
    16: ((16, 64), (32, 64)),
    64: ((64, 64), (64, 128)),
    256: ((128, 128),),
}


def triton_name(block_m: int, block_n: int) -> str:
    return f"triton_{block_m}x{block_n}"


class CudaLinear:
    """GPTQ Linears (model/gptq.GPTQLinear) reading the same input, as one matmul."""

    def __init__(self, parts: Sequence[Any], dtype: torch.dtype) -> None:
        first = parts[0]
        for part in parts[1:]:
            same = (part.bits, part.group_size, part.in_features) == (
                first.bits,
                first.group_size,
                first.in_features,
            )
            if not same or not _same_perm(part.perm, first.perm):
                raise ValueError("fused projections differ in bits, groups, width or order")
        self.bits, self.group_size = first.bits, first.group_size
        self.in_features = first.in_features
        self.dtype = dtype  # of the activations
        self.splits = [int(p.out_features) for p in parts]
        self.out_features = sum(self.splits)
        self.qweight = torch.cat([p.qweight for p in parts], dim=1).contiguous()
        self.scales = torch.cat([p.scales for p in parts], dim=1).contiguous()
        self.zeros = torch.cat([p.zeros for p in parts], dim=1).to(torch.uint8).contiguous()
        self.perm = first.perm
        biases = [p.bias for p in parts]
        self.bias: torch.Tensor | None = None
        if any(b is not None for b in biases):
            self.bias = torch.cat(
                [
                    b if b is not None else torch.zeros(p.out_features, device=self.qweight.device)
                    for b, p in zip(biases, parts, strict=True)
                ]
            ).to(dtype)
        self._kernels: dict[str, Kernel] = {}
        self._by_rows: list[Kernel] = []
        self.plan: list[tuple[int, str]] = []

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(out features, in features, group size, bits): what the autotune measures per."""
        return (self.out_features, self.in_features, self.group_size, self.bits)

    def candidates(self, rows: int) -> list[str]:
        """The kernels that can serve `rows` rows here."""
        names = []
        if self._tinygemm_fits():
            names.append(TINYGEMM)
        tiles = [t for low, tiles in TRITON_TILES.items() if rows >= low for t in tiles]
        tiles = tiles[-2:] if rows > 1 else tiles  # the tiles of the largest bucket reached
        names += [triton_name(m, n) for m, n in tiles]
        names.append(DENSE)
        return names

    def _tinygemm_fits(self) -> bool:
        return (
            self.dtype == torch.bfloat16
            and self.bits == 4
            and self.group_size in (32, 64, 128, 256)
            and self.in_features % 32 == 0
            and self.out_features % 8 == 0
        )

    def kernel(self, name: str) -> Kernel:
        """The kernel `name`, built now if it is not yet."""
        if name not in self._kernels:
            if name == TINYGEMM:
                self._kernels[name] = self._tinygemm()
            elif name == DENSE:
                self._kernels[name] = self._dense()
            elif name.startswith("triton_"):
                block_m, block_n = (int(v) for v in name.removeprefix("triton_").split("x"))
                self._kernels[name] = self._triton(block_m, block_n)
            else:
                raise ValueError(f"unknown GPU kernel {name!r}")
        return self._kernels[name]

    def use(self, plan: Sequence[tuple[int, str]]) -> None:
        """Serve `plan`: (fewest rows, kernel) pairs, the first at 1 row; unused kernels go."""
        plan = sorted((int(rows), name) for rows, name in plan)
        if not plan or plan[0][0] != 1:
            raise ValueError("a plan starts at 1 row")
        kernels = {name: self.kernel(name) for _, name in plan}
        self._by_rows = [kernels[plan[0][1]]]
        for rows in range(1, plan[-1][0] + 1):
            self._by_rows.append(kernels[[n for low, n in plan if low <= rows][-1]])
        self.plan = list(plan)
        self._kernels = kernels

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] (rows contiguous) -> [M, N]."""
        if self.perm is not None:
            x = x.index_select(1, self.perm)
        rows, table = x.shape[0], self._by_rows
        out = table[rows if rows < len(table) else -1](x)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(out.split(self.splits, dim=-1))

    def release_weights(self) -> None:
        """Drop the packed tensors no chosen kernel reads (after `use`)."""
        if not any(name.startswith("triton_") for name in self._kernels):
            self.qweight = torch.empty(0, dtype=torch.int32, device=self.qweight.device)
            self.zeros = torch.empty(0, dtype=torch.uint8, device=self.qweight.device)

    def _dense(self) -> Kernel:
        codes = unpack_rows(self.qweight, self.bits, self.in_features)
        groups = torch.arange(self.in_features, device=codes.device) // self.group_size
        weight = dequantize(codes, self.zeros, self.scales, groups).t().to(self.dtype)  # [N, K]
        weight = weight.contiguous()
        return lambda x: torch.nn.functional.linear(x, weight)

    def _tinygemm(self) -> Kernel:
        if not self._tinygemm_fits():
            raise ValueError(f"tinygemm cannot serve {self.shape}")
        codes = unpack_rows(self.qweight, 4, self.in_features).t().contiguous()  # [N, K]
        packed = ((codes[:, ::2] << 4) | codes[:, 1::2]).to(torch.uint8)
        inner = 8 if self.in_features % 128 == 0 else 4 if self.in_features % 64 == 0 else 2
        weight = internals.convert_to_int4pack_cuda(packed, inner)
        scale = self.scales.float()  # [G, N]
        zero = scale * (8.0 - self.zeros.float())  # (code - 8) * scale + zero = scale (code - z)
        scales_and_zeros = torch.stack((scale, zero), dim=2).to(torch.bfloat16).contiguous()
        group = self.group_size

        def run(x: torch.Tensor) -> torch.Tensor:
            return internals.int4pack_mm_cuda(x, weight, group, scales_and_zeros)

        return run

    def _triton(self, block_m: int, block_n: int) -> Kernel:
        from predictor.engine.runners.cuda.triton_ops import gptq_block_k, gptq_matmul

        gptq_block_k(self.group_size, self.in_features)  # raises where no step fits
        bits, group = self.bits, self.group_size
        warps = 8 if block_m * block_n >= 128 * 128 else 4

        def run(x: torch.Tensor) -> torch.Tensor:
            return gptq_matmul(
                x, self.qweight, self.scales, self.zeros, bits, group, block_m, block_n, warps
            )

        return run


def _same_perm(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    return bool(torch.equal(a, b))


def fuse(parts: Sequence[Any], dtype: torch.dtype) -> list[CudaLinear]:
    """`parts` as one CudaLinear where they can be fused, else one each."""
    try:
        return [CudaLinear(parts, dtype)]
    except ValueError:
        return [CudaLinear([p], dtype) for p in parts]
