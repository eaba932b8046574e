"""Give a finished step's memory back to the system.

Freed tensors and Python objects go back to glibc's heap, which keeps the pages for reuse: a
build's RSS then stays at its largest step's however little the next one needs. `release`
collects the garbage (a layer's modules in reference cycles) and asks glibc to return the
free pages at the top and inside its arenas (`malloc_trim(0)`); elsewhere (no glibc) it only
collects.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc


def release() -> None:
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
