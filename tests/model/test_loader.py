from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from predictor.errors import CheckpointError
from predictor.model.loader import check_checkpoint, load_checkpoint
from tests.support import REPO


def test_dense_checkpoint_is_not_gptq(tiny_dense_dir: Path) -> None:
    with pytest.raises(CheckpointError, match="not a GPTQ checkpoint"):
        check_checkpoint(tiny_dense_dir)


def test_gptq_checkpoint_loads_with_cpu_kernels(tiny_gptq_dir: Path) -> None:
    assert check_checkpoint(tiny_gptq_dir)["bits"] == 4
    loaded = load_checkpoint(tiny_gptq_dir, device="auto", threads=1)
    assert loaded.device.type == "cpu"
    assert loaded.kernel != "none"  # Linear layers were replaced by a gptqmodel kernel
    assert loaded.tokenizer.chat_template
    assert loaded.eos_ids


@pytest.mark.parametrize("kind", ["missing", "empty", "dense"])
def test_server_refuses_a_folder_that_is_not_gptq(
    kind: str, tmp_path: Path, tiny_dense_dir: Path
) -> None:
    folder = {"missing": tmp_path / "nothing", "empty": tmp_path, "dense": tiny_dense_dir}[kind]
    done = subprocess.run(
        [sys.executable, "-m", "predictor", "--model-dir", str(folder), "--http-port", "0"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.startswith("predictor:")]
    assert len(lines) == 1 and str(folder) in lines[0]
    assert "Traceback" not in done.stderr


def test_broken_config_is_one_clear_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot be read"):
        check_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(
        json.dumps({"quantization_config": {"quant_method": "gptq"}})
    )
    with pytest.raises(CheckpointError, match="no weight files"):
        check_checkpoint(tmp_path)
