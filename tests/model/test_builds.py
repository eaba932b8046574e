"""Where a finished build goes (model/builds.py): the rejected build's folder and report, its
installation on request, and the kernel a build records for the server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from predictor.model.builds import (
    QUALITY_FILE,
    accept_rejected,
    install,
    keep_rejected,
    recorded_kernel,
    rejected_path,
)


def staged_build(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "quantize_config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"weights")
    return folder


def test_a_refused_build_is_kept_beside_its_out_and_installed_on_request(tmp_path: Path) -> None:
    out = tmp_path / "my-gptq"
    (rejected_path(out)).mkdir()  # an older refused build: replaced
    kept = keep_rejected(staged_build(tmp_path / "staged"), out, {"ratio": 1.3}, "too far")
    assert kept == tmp_path / "my-gptq.rejected" and not (tmp_path / "staged").exists()
    assert json.loads((kept / QUALITY_FILE).read_text()) == {"ratio": 1.3, "rejected": "too far"}
    assert accept_rejected(kept) == out and not kept.exists()
    quality = json.loads((out / QUALITY_FILE).read_text())
    assert quality["ratio"] == 1.3 and quality["accepted"]["refused_for"] == "too far"
    assert (out / "model.safetensors").read_bytes() == b"weights"


def test_only_a_refused_build_is_accepted(tmp_path: Path) -> None:
    built = staged_build(tmp_path / "built.rejected")
    with pytest.raises(SystemExit, match="it has no quality.json"):
        accept_rejected(built)
    (built / QUALITY_FILE).write_text(json.dumps({"ratio": 1.0}))
    with pytest.raises(SystemExit, match="records no rejection"):
        accept_rejected(built)
    (built / QUALITY_FILE).write_text(json.dumps({"rejected": "x"}))
    (built / "model.safetensors").unlink()
    with pytest.raises(SystemExit, match="checkpoint files are missing"):
        accept_rejected(built)
    other = staged_build(tmp_path / "elsewhere")
    (other / QUALITY_FILE).write_text(json.dumps({"rejected": "x"}))
    with pytest.raises(SystemExit, match="name the folder to install with --out"):
        accept_rejected(other)
    assert accept_rejected(other, tmp_path / "named") == tmp_path / "named"


def test_the_kernel_a_build_recorded(tmp_path: Path) -> None:
    assert recorded_kernel(tmp_path) is None  # no report
    (tmp_path / QUALITY_FILE).write_text(json.dumps({"ratio": 1.0}))
    assert recorded_kernel(tmp_path) is None  # none chosen
    (tmp_path / QUALITY_FILE).write_text(json.dumps({"serve": {"kernel": "native_f32"}}))
    assert recorded_kernel(tmp_path) == "native_f32"
    (tmp_path / QUALITY_FILE).write_text("not json")
    assert recorded_kernel(tmp_path) is None


def test_an_installed_build_is_readable_as_the_umask_allows(tmp_path: Path) -> None:
    """gptqmodel wrote model.safetensors 0600 and a temporary folder is 0700: a server running
    as another user could not read the build."""
    import os
    import stat

    staged = tmp_path / "staged"
    (staged / "sub").mkdir(parents=True)
    (staged / "model.safetensors").write_bytes(b"x")
    (staged / "model.safetensors").chmod(0o600)
    staged.chmod(0o700)
    old = os.umask(0o022)
    try:
        install(staged, tmp_path / "out")
    finally:
        os.umask(old)
    out = tmp_path / "out"
    assert stat.S_IMODE((out / "model.safetensors").stat().st_mode) == 0o644
    assert stat.S_IMODE(out.stat().st_mode) == stat.S_IMODE((out / "sub").stat().st_mode) == 0o755
