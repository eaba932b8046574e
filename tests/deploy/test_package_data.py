"""pyproject.toml's package data: every non-Python file the predictor reads at run time ships."""

from __future__ import annotations

import tomllib

from tests.support import REPO


def test_every_c_source_text_and_json_of_the_package_is_package_data() -> None:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    listed = set(config["tool"]["setuptools"]["package-data"]["predictor"])
    package = REPO / "predictor"
    needed = {
        str(path.relative_to(package))
        for pattern in ("*.c", "*.txt", "*.json")
        for path in package.rglob(pattern)
    }
    assert needed - listed == set(), "add these to [tool.setuptools.package-data]"
