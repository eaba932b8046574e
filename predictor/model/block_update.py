"""GPTQ's column loop in C on the CPU: gptqmodel's 128-column block update, which it has for CUDA.

`GPTQ.quantize` quantizes a module's weights one column at a time: a dozen small tensor
operations a column in Python (4,992 columns a layer of SmolLM2-135M, 150k in all). On a CUDA
device gptqmodel runs each 128-column block as one kernel instead (`gptq_cuda.gptq_block_update`,
the eager loop's operations bit for bit: it prepares every group's scale and zero point of the
block first, which the loop reads from the weights before the block changes them).
`fused_block_update()` lets GPTQ.quantize take that path on the CPU too, with `block_update.c`
(built at first use with predictor.toolchain) as its kernel: the same operations in the same
order and rounding, so the checkpoint is the same (tests/model/test_block_update.py). Its calls
release the GIL: gptqmodel's two solve workers run on both cores.

How: the condition that picks the fused path is a line of GPTQ.quantize that names CUDA
(`FUSED_CONDITION`, internals item GPTQ_FUSED_BLOCK). Within the block, GPTQ.quantize is
gptqmodel's own source with that one line widened to the CPU, and gptq_cuda's two functions
answer for a CPU tensor with this kernel (for a CUDA one, with gptqmodel's). Where the line is not
found, or no compiler is, gptqmodel's code runs unchanged. The timings are in load/RESULTS.md,
"make model profile".
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import inspect
import logging
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from predictor import toolchain
from predictor.model import internals

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("block_update.c")
# No fused multiply-add and no reordered float arithmetic: each operation as torch computes it.
FLAGS = ["-O3", "-fno-math-errno", "-ffp-contract=off"]
WIDTH = 128  # block_update.c: WIDTH, gptqmodel's block size for the fused path


@contextlib.contextmanager
def fused_block_update() -> Iterator[None]:
    """Within the block, GPTQ.quantize runs its 128-column blocks through block_update.c."""
    kernel = _kernel()
    gptq, cuda = internals.gptq_class(), internals.gptq_cuda_module()
    quantize = _widened(gptq.quantize) if kernel is not None else None
    if kernel is None or quantize is None:
        yield
        return
    saved = (gptq.quantize, cuda.block_update_available, cuda.gptq_block_update)
    available, update = saved[1], saved[2]
    gptq.quantize = quantize
    # without CUDA every block is on the CPU; with it, a CPU block is too (see _dispatch)
    cuda.block_update_available = lambda: not torch.cuda.is_available() or available()
    cuda.gptq_block_update = _dispatch(kernel, update)
    try:
        yield
    finally:
        gptq.quantize, cuda.block_update_available, cuda.gptq_block_update = saved


def _widened(original: Callable[..., Any]) -> Callable[..., Any] | None:
    """GPTQ.quantize with FUSED_CONDITION widened to the CPU; None where gptqmodel's source is
    not the one this was written against."""
    function = inspect.unwrap(original)
    try:
        lines, first = inspect.getsourcelines(function)
    except (OSError, TypeError):
        return None
    source = textwrap.dedent("".join(lines))
    module = inspect.getmodule(function)
    if module is None or source.count(internals.FUSED_CONDITION) != 1:
        logger.info("GPTQ's column loop runs in torch: gptqmodel's fused path changed")
        return None
    source = source.replace(internals.FUSED_CONDITION, internals.FUSED_CONDITION_CPU)
    namespace: dict[str, Any] = {}
    # blank lines first: a traceback names gptq.py's own line numbers
    code = compile("\n" * (first - 1) + source, inspect.getsourcefile(function) or "<gptq>", "exec")
    exec(code, vars(module), namespace)  # gptqmodel's own method, one condition widened
    widened: Callable[..., Any] = namespace[function.__name__]
    return widened


def _dispatch(kernel: Any, cuda_update: Callable[..., None]) -> Callable[..., None]:
    def update(
        work: torch.Tensor,
        hinv: torch.Tensor,
        scale: torch.Tensor,
        zero: torch.Tensor,
        column_group: torch.Tensor,
        quantized: torch.Tensor,
        errors: torch.Tensor,
        losses: torch.Tensor,
        maxq: int,
    ) -> None:
        if work.device.type != "cpu":
            cuda_update(work, hinv, scale, zero, column_group, quantized, errors, losses, maxq)
            return
        run_block(kernel, work, hinv, scale, zero, column_group, quantized, errors, losses, maxq)

    return update


def run_block(
    kernel: Any,
    work: torch.Tensor,  # [rows, 128], contiguous columns: updated in place
    hinv: torch.Tensor,  # [128, 128]
    scale: torch.Tensor,  # [groups, rows]
    zero: torch.Tensor,  # [groups, rows]
    column_group: torch.Tensor,  # [128] int32: each column's row of scale and zero
    quantized: torch.Tensor,  # [rows, 128] out
    errors: torch.Tensor,  # [rows, 128] out
    losses: torch.Tensor,  # [rows, 128] out
    maxq: int,
) -> None:
    """One block through block_update.c, after the checks gptqmodel's CUDA op makes."""
    rows = work.shape[0]
    tensors = (work, hinv, scale, zero, quantized, errors, losses)
    if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in tensors):
        raise ValueError("the block update takes float32 CPU tensors")
    hinv = hinv.contiguous()
    scale, zero = scale.contiguous(), zero.contiguous()
    group = column_group.to(torch.int32).contiguous()
    if (
        work.shape != (rows, WIDTH)
        or hinv.shape != (WIDTH, WIDTH)
        or scale.shape != zero.shape
        or scale.dim() != 2
        or scale.shape[1] != rows
        or group.shape != (WIDTH,)
        or any(t.shape != work.shape or t.stride(1) != 1 for t in (work, quantized, errors, losses))
        or int(group.min()) < 0
        or int(group.max()) >= scale.shape[0]
    ):
        raise ValueError("the block update's tensors do not have gptqmodel's shapes")
    kernel(
        work.data_ptr(),
        work.stride(0),
        hinv.data_ptr(),
        hinv.stride(0),
        scale.data_ptr(),
        zero.data_ptr(),
        scale.stride(0),
        group.data_ptr(),
        quantized.data_ptr(),
        quantized.stride(0),
        errors.data_ptr(),
        errors.stride(0),
        losses.data_ptr(),
        losses.stride(0),
        rows,
        float(maxq),
    )


@functools.cache
def _kernel() -> Any | None:
    """block_update.c built for this CPU (once a process), or None where it cannot be built."""
    library = toolchain.build_or_none(SOURCE, FLAGS, "GPTQ's column loop runs in torch")
    if library is None:  # a CDLL: its calls release the GIL
        return None
    pointer, integer = ctypes.c_void_p, ctypes.c_int64
    function = library.block_update
    function.restype = None
    function.argtypes = [pointer, integer, pointer, integer, pointer, pointer, integer, pointer]
    function.argtypes += [pointer, integer, pointer, integer, pointer, integer, integer]
    function.argtypes += [ctypes.c_float]
    return function
