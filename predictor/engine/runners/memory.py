"""Giving memory back once the runner's kernels hold their own layouts (the server's RSS).

Two kinds of pages stay resident after the autotune for nothing:
- the checkpoint's weights as transformers mapped them from the `.safetensors` file: every
  tensor is a view of one private file mapping, whose pages were all read once (the int4
  repacking, the lm_head copies) and then stay counted in RSS while any view lives (the tied
  embedding does). `release_mapped_weights` tells the kernel it may drop them
  (madvise MADV_DONTNEED): clean file pages, read again from the page cache where touched (the
  embedding rows a step looks up), so every tensor keeps working;
- the heap the autotune's losing candidates used (each layer's bf16 copies are a few MB, below
  glibc's mmap threshold, so freeing them leaves the heap large): `trim_heap` (malloc_trim).

Both are Linux/glibc calls through ctypes; elsewhere they do nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from pathlib import Path

logger = logging.getLogger(__name__)

MADV_DONTNEED = 4
SUFFIX = ".safetensors"


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name or "libc.so.6", use_errno=True)
    except OSError:
        return None


def mapped_ranges(suffix: str = SUFFIX, maps: Path = Path("/proc/self/maps")) -> list[tuple[int, int]]:
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


def release_mapped_weights() -> int:
    """Drop the resident pages of the checkpoint's mapped weights; bytes advised."""
    libc = _libc()
    if libc is None:
        return 0
    advised = 0
    for start, end in mapped_ranges():
        if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_DONTNEED):
            logger.info("madvise of a weight mapping failed (errno %d)", ctypes.get_errno())
            continue
        advised += end - start
    return advised


def trim_heap() -> None:
    """Return the heap's free pages to the system (glibc's malloc_trim)."""
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None) if libc is not None else None
    if trim is not None:
        trim(0)
