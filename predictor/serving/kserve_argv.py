"""Item 1 of `serving/internals.py` (ARGV_WIPE), kept apart because it must run before the first
import of kserve: `kserve.model_server` parses `sys.argv` when it is imported."""

from __future__ import annotations

import sys


def hide_argv_from_kserve() -> None:
    """Call before the first import of kserve (our Settings have read argv already)."""
    sys.argv = sys.argv[:1]
