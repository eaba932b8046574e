"""Giving memory back once the runner's kernels hold their own layouts (the server's RSS).

Two kinds of pages stay resident after the autotune for nothing:
- the checkpoint's weights as transformers mapped them from the `.safetensors` file: every
  tensor is a view of one private file mapping, whose pages were all read once (the int4
  repacking, the lm_head copies) and then stay counted in RSS while any view lives (the tied
  embedding does). `release_mapped_weights` tells the kernel it may drop them (madvise
  MADV_DONTNEED; only pages never written, as /proc/self/pagemap tells): clean file pages,
  read again from the page cache where touched (the embedding rows a step looks up), so every
  tensor keeps working;
- the heap the autotune's losing candidates used (each layer's bf16 copies are a few MB, below
  glibc's mmap threshold, so freeing them leaves the heap large): `trim_heap` (malloc_trim).

Both are Linux/glibc calls through ctypes; elsewhere they do nothing. And for a server, whose
model only the runner runs, `empty_tensors` empties the model's own 4-bit modules once every
layer runs from the runner's fused copies.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import struct
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

MADV_DONTNEED = 4
SUFFIX = ".safetensors"


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name or "libc.so.6", use_errno=True)
    except OSError:
        return None


def mapped_ranges(
    suffix: str = SUFFIX, maps: Path = Path("/proc/self/maps")
) -> list[tuple[int, int]]:
    """[start, end) of this process's private file mappings whose path ends with `suffix`."""
    try:
        lines = maps.read_text().splitlines()
    except OSError:
        return []
    ranges = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].endswith(suffix) and fields[1].endswith("p"):
            start, end = (int(part, 16) for part in fields[0].split("-"))
            ranges.append((start, end))
    return ranges


def clean_runs(
    start: int, end: int, pagemap: Path = Path("/proc/self/pagemap")
) -> list[tuple[int, int]]:
    """The runs of [start, end) whose resident pages are all still the file's (pagemap: present
    and file-backed); a page written since (copy-on-write: anonymous) splits them and stays, so
    no written number is lost. Pages not resident are left out too (nothing to give back)."""
    page = mmap.PAGESIZE
    try:
        with open(pagemap, "rb") as file:
            file.seek(start // page * 8)
            data = file.read((end - start) // page * 8)
    except OSError:
        return []
    runs: list[tuple[int, int]] = []
    for index, (entry,) in enumerate(struct.iter_unpack("<Q", data)):
        present, file_page = entry >> 63 & 1, entry >> 61 & 1
        if not (present and file_page):
            continue
        address = start + index * page
        if runs and runs[-1][1] == address:
            runs[-1] = (runs[-1][0], address + page)
        else:
            runs.append((address, address + page))
    return runs


def release_mapped_weights() -> int:
    """Drop the resident, unwritten pages of the checkpoint's mapped weights; bytes advised."""
    libc = _libc()
    if libc is None:
        return 0
    advised = 0
    for start, end in mapped_ranges():
        for low, high in clean_runs(start, end):
            if libc.madvise(ctypes.c_void_p(low), ctypes.c_size_t(high - low), MADV_DONTNEED):
                logger.info("madvise of a weight mapping failed (errno %d)", ctypes.get_errno())
                break
            advised += high - low
    return advised


def trim_heap() -> None:
    """Return the heap's free pages to the system (glibc's malloc_trim)."""
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None) if libc is not None else None
    if trim is not None:
        trim(0)


def empty_tensors(module: Any) -> None:
    """Replace every tensor a module holds (buffers, parameters, plain attributes) by an empty
    one of its dtype: for modules whose numbers live elsewhere now."""
    for table in (module._buffers, module._parameters):
        for name, tensor in list(table.items()):
            if tensor is not None:
                empty = torch.empty(0, dtype=tensor.dtype)
                table[name] = (
                    torch.nn.Parameter(empty, False) if table is module._parameters else empty
                )
    for name, value in list(vars(module).items()):
        if isinstance(value, torch.Tensor):
            setattr(module, name, torch.empty(0, dtype=value.dtype))
