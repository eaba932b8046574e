"""Batch invariance of a matmul kernel (--batch-invariant): whether each row of its output is
the same, bit for bit, whatever other rows share the call, checked on this machine; and a kernel
called one row at a time, invariant by construction, for where none is."""

from __future__ import annotations

from collections.abc import Callable

import torch

Kernel = Callable[[torch.Tensor], torch.Tensor]

ROWWISE = "rows_"  # a kernel called one row at a time (row-invariant by construction)


def rowwise(kernel: Kernel) -> Kernel:
    """`kernel` on one row at a time: each row's result is what that row alone gives, whatever
    rows share its call (for --batch-invariant, where no faster kernel is row-invariant)."""

    def run(x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= 1:  # one row, or none (a step with no logits to return)
            return kernel(x)
        return torch.cat([kernel(x[i : i + 1]) for i in range(x.shape[0])])

    return run


def row_invariant(
    kernel: Kernel, width: int, generator: torch.Generator, dtype: torch.dtype = torch.bfloat16
) -> bool:
    """Whether each row of `kernel`'s output is the same, bit for bit, whatever other rows share
    the call: checked at the row counts the buckets start at, and odd ones between, on inputs
    of `dtype` (the model's activations)."""
    x = (torch.randn((65, width), generator=generator) * 0.5).to(dtype)
    with torch.inference_mode():
        full = kernel(x)
        return all(torch.equal(kernel(x[:rows]), full[:rows]) for rows in (1, 2, 3, 8, 15, 16, 33))
