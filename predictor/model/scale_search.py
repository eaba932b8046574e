"""gptqmodel's MSE scale search, vectorised: every shrink candidate of a group in one pass.

With `mse > 0` gptqmodel's `Quantizer.find_params` tries 80 shrunk ranges (p = 1, 0.99, ... 0.21)
for each group of 32 columns, one after another: eight small tensor operations and a
synchronising `torch.any` per candidate, thousands of groups a model: the largest single cost
of `make model` before this (load/RESULTS.md, "make model profile"). `vectorised_scale_search()`
swaps in a method that scores all candidates of a group as one [candidates, rows, columns]
tensor and keeps, per row, the first candidate with the least error: the choice the loop makes
(it replaces the best only on a strictly smaller error), so the checkpoint is the same
(tests/model/test_scale_search.py compares the two bit for bit).

It also skips the search on the whole-matrix call that `GPTQ.quantize` makes before its column
loop when the weights are grouped: every group's parameters are searched again inside the loop
before any column is quantized, so that first result is never used (an 80-candidate search over
a whole [1536, 576] matrix per module, 14% of the search time).

The search of a group, and the range it starts from, run in C where a compiler is found
(`scale_search.c`, built at first use with predictor.toolchain), one call a group, the same
choice bit for bit: every element is computed as torch computes it and each row's error is
summed in the order of torch's own sum, which the module checks against torch.sum once a
process before it uses the kernel (elsewhere: the torch version below). Its calls release the
GIL, so gptqmodel's two solve workers search on both cores beside the calibration forwards.
The range is computed in C as well (a dozen small torch operations a group otherwise, each
taking the GIL back), and a search that runs alone (o_proj's, down_proj's) splits its rows over
the build's threads. The timings are in load/RESULTS.md, "make model profile".

Cases this does not cover (symmetric 2-bit orientation search, group-wise QQQ, trits, a
search that is not per channel) go to gptqmodel's own method unchanged.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from predictor import toolchain
from predictor.model import internals

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("scale_search.c")
# No fused multiply-add and no reordered float arithmetic: each element as torch computes it.
FLAGS = ["-O3", "-fno-math-errno", "-ffp-contract=off", "-pthread"]
MAX_NATIVE_STEPS = 256  # scale_search.c: MAX_STEPS

# Candidates x rows x columns per chunk: each temporary (1 MiB fp32) stays in a core's L2 cache,
# which is faster than one [80, rows, 32] tensor and than gptqmodel's loop.
CHUNK_ELEMENTS = 1 << 18


@contextlib.contextmanager
def vectorised_scale_search() -> Iterator[None]:
    """Within the block, gptqmodel's Quantizer.find_params is the vectorised search."""
    quantizer = internals.quantizer_class()
    original = quantizer.find_params

    def find_params(self: Any, x: torch.Tensor, weight: bool = False) -> None:
        if not _covered(self, x, weight):
            original(self, x, weight)
            return
        _find_params(self, x, search=not _unused_whole_matrix_call(self, x))

    quantizer.find_params = find_params
    try:
        yield
    finally:
        quantizer.find_params = original


def _covered(quantizer: Any, x: torch.Tensor, weight: bool) -> bool:
    maxq = int(quantizer.maxq.item())
    return (
        weight
        and x.dim() == 2
        and bool(getattr(quantizer, "perchannel", False))
        and maxq > 0
        and not quantizer.requires_groupwise_processing()
        and not internals.searches_adjacent_zero_points(quantizer)
    )


def _unused_whole_matrix_call(quantizer: Any, x: torch.Tensor) -> bool:
    group_size = int(getattr(quantizer.qcfg, "group_size", -1) or -1)
    return group_size > 0 and x.shape[1] > group_size


@torch.no_grad()
def _find_params(quantizer: Any, x: torch.Tensor, search: bool) -> None:
    """Set quantizer.scale and .zero ([rows, 1]) for x: [rows, columns], as find_params does."""
    maxq = quantizer.maxq.to(x.device)
    quantizer.maxq = maxq
    sym = bool(quantizer.qcfg.sym)
    power = float(getattr(quantizer.qcfg, "mse", 0.0) or 0.0)
    searching = power > 0.0 and search
    native = _native_search()
    if native is not None and _native_fits(x, power if searching else 2.0, native):
        shrink = _shrinks(quantizer, torch.float32, torch.device("cpu")) if searching else None
        if shrink is None or shrink.numel() <= MAX_NATIVE_STEPS:
            scale, zero = _find_native(native, x, shrink, maxq, sym)
            quantizer.scale, quantizer.zero = scale.reshape(-1, 1), zero.reshape(-1, 1)
            return
    zeros = torch.zeros(x.shape[0], device=x.device)
    xmin = torch.minimum(x.min(1)[0], zeros)  # [rows]
    xmax = torch.maximum(x.max(1)[0], zeros)
    if sym:
        xmax = torch.maximum(torch.abs(xmin), xmax)
        negative = xmin < 0
        if torch.any(negative):
            xmin[negative] = -xmax[negative]
    flat = (xmin == 0) & (xmax == 0)
    xmin[flat] = -1
    xmax[flat] = +1
    scale = (xmax - xmin) / maxq
    zero = torch.full_like(scale, (maxq + 1) / 2) if sym else torch.round(-xmin / scale)
    if searching:
        scale, zero = _search(quantizer, x, xmin, xmax, scale, zero, maxq, sym, power)
    quantizer.scale = scale.reshape(-1, 1)
    quantizer.zero = zero.reshape(-1, 1)


def _shrinks(quantizer: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The candidates' range factors, in gptqmodel's order: 1, 1 - 1/grid, ... (maxshrink)."""
    grid = int(quantizer.grid)
    steps = int(quantizer.maxshrink * grid)
    return torch.tensor([1 - i / grid for i in range(steps)], dtype=dtype, device=device)


def _search(
    quantizer: Any,
    x: torch.Tensor,  # [rows, columns]
    xmin: torch.Tensor,  # [rows]
    xmax: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    maxq: torch.Tensor,
    sym: bool,
    power: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The candidate with the least sum |q(x) - x|^power per row; the first one on ties."""
    shrink = _shrinks(quantizer, x.dtype, x.device)
    steps = shrink.numel()
    rows, columns = x.shape
    per_chunk = max(1, CHUNK_ELEMENTS // max(1, rows * columns))
    best = torch.full([rows], float("inf"), device=x.device)
    best_scale, best_zero = scale.clone(), zero.clone()
    for start in range(0, steps, per_chunk):
        p = shrink[start : start + per_chunk].unsqueeze(1)  # [C, 1]
        xmin1, xmax1 = p * xmin, p * xmax  # [C, rows]
        scale1 = (xmax1 - xmin1) / maxq
        zero1 = zero.expand_as(scale1) if sym else torch.round(-xmin1 / scale1)
        s, z = scale1.unsqueeze(2), zero1.unsqueeze(2)  # [C, rows, 1]
        q = torch.div(x, s)  # [C, rows, columns]; in place from here: one buffer
        q.round_().add_(z).clamp_(torch.zeros_like(maxq), maxq).sub_(z).mul_(s).sub_(x)
        q.abs_().pow_(power)
        err = torch.sum(q, 2)  # [C, rows]
        del q
        # min over candidates; NaN errors never win (the loop's `err < best` is False for them)
        err = torch.nan_to_num(err, nan=float("inf"))
        chunk_best, index = torch.min(err, 0)  # the first minimum on ties
        better = chunk_best < best
        rows_index = torch.arange(rows, device=x.device)
        best = torch.where(better, chunk_best, best)
        best_scale = torch.where(better, scale1[index, rows_index], best_scale)
        best_zero = torch.where(better, zero1[index, rows_index], best_zero)
    return best_scale, best_zero


@dataclass(frozen=True)
class NativeSearch:
    """scale_search.c loaded: find_params (the range and the search), and the widest group it
    sums in torch's order."""

    find_params: Any  # ctypes function
    max_columns: int


@functools.cache
def _native_search() -> NativeSearch | None:
    """scale_search.c built for this CPU (once a process), or None where it cannot be built or
    does not sum as torch does here."""
    library = toolchain.build_or_none(SOURCE, FLAGS, "the scale search runs in torch")
    if library is None:  # a CDLL: its calls release the GIL
        return None
    pointer, integer = ctypes.c_void_p, ctypes.c_int64
    find, sums, widest = library.find_params, library.row_sums, library.max_columns
    find.restype, sums.restype, widest.restype = None, None, integer
    find.argtypes = [pointer, integer, integer, integer, ctypes.c_float, ctypes.c_int32]
    find.argtypes += [ctypes.c_float, pointer, integer, pointer, pointer, integer]
    sums.argtypes = [pointer, integer, integer, pointer]
    native = NativeSearch(find, int(widest()))
    if not _sums_as_torch_does(sums, native.max_columns):
        logger.info("the scale search runs in torch: torch.sum adds in another order here")
        return None
    return native


def _sums_as_torch_does(sums: Any, max_columns: int) -> bool:
    """The kernel's row sums equal torch.sum's bit for bit, over widths up to `max_columns`
    (random squares: about half of the rows' sums differ in their last bits in another order)."""
    generator = torch.Generator().manual_seed(0)
    for columns in sorted({1, 3, 7, 8, 9, 31, 32, 33, 64, 100, 128, 250, max_columns}):
        x = torch.randn(256, columns, generator=generator).square().contiguous()
        out = torch.empty(256)
        sums(x.data_ptr(), 256, columns, out.data_ptr())
        if not torch.equal(out, torch.sum(x, 1)):
            return False
    return True


def _native_fits(x: torch.Tensor, power: float, native: NativeSearch) -> bool:
    return (
        power == 2.0
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and x.stride(1) == 1
        and 0 < x.shape[1] <= native.max_columns
    )


def _find_native(
    native: NativeSearch,
    x: torch.Tensor,  # [rows, columns], rows apart by x.stride(0)
    shrink: torch.Tensor | None,  # the candidates (fp32, CPU); None: no search
    maxq: torch.Tensor,
    sym: bool,
    threads: int | None = None,  # None: torch's threads while no other search runs, else one
) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole of `_find_params` for one group in C, one call: the range, its scale and
    zero and, with `shrink`, the search for power 2 (`_search`'s candidates, sums and rule).
    In torch that is a dozen small operations a group, each taking the GIL back between the
    solve workers; this call releases it once."""
    rows, columns = x.shape
    scale, zero = torch.empty(rows, dtype=torch.float32), torch.empty(rows, dtype=torch.float32)
    top = float(maxq.item())
    steps = 0 if shrink is None else shrink.numel()
    with _IN_FLIGHT.running() as alone:
        if threads is None:  # a range without a search takes microseconds: one thread
            threads = torch.get_num_threads() if alone and steps else 1
        native.find_params(
            x.data_ptr(),
            rows,
            columns,
            x.stride(0),
            top,
            int(sym),
            (top + 1) / 2,
            None if shrink is None else shrink.data_ptr(),
            steps,
            scale.data_ptr(),
            zero.data_ptr(),
            threads,
        )
    return scale, zero


class _Searches:
    """How many C searches run now. gptqmodel's two solve workers both search while both solve
    a module (q beside k and v, gate beside up); o_proj and down_proj are solved alone, the
    other worker idle and the main thread waiting, and a search then splits its rows over the
    build's threads (torch's: `--threads`; the same numbers, each row's search its own). A
    search that starts while the other worker is between two of its own takes them too: for its
    few milliseconds three threads share two cores."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0

    @contextlib.contextmanager
    def running(self) -> Iterator[bool]:
        """Within the block this search counts; it yields whether it was the only one."""
        with self._lock:
            self._count += 1
            alone = self._count == 1
        try:
            yield alone
        finally:
            with self._lock:
                self._count -= 1


_IN_FLIGHT = _Searches()
