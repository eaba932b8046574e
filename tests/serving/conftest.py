"""Fixtures shared by the serving tests' modules."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import ServerProcess


@pytest.fixture(scope="session")
def small(tiny_gptq_dir: Path) -> Iterator[ServerProcess]:
    """The tiny model on 1 batch row and 1 waiting place (the overload tests of every route);
    each test leaves it idle."""
    extra = ["--max-batch-size", "1", "--max-waiting", "1", "--max-tokens-limit", "900"]
    with ServerProcess.start(tiny_gptq_dir, "tiny", extra=extra) as srv:
        yield srv
