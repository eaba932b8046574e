"""`python -m predictor`'s wiring (predictor/__main__.py) where it chooses for the user: the
kernel a checkpoint's build recorded, honoured by default and overridden by --kernel."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from predictor.model.builds import QUALITY_FILE
from tests.support import ServerProcess, run_predictor


def plans(log: str) -> list[str]:
    return [line for line in log.splitlines() if "kernel (" in line and " x" in line]


def test_the_kernel_a_build_recorded_is_served_unless_overridden(
    tiny_bf16_dir: Path, tmp_path: Path
) -> None:
    checkpoint = shutil.copytree(tiny_bf16_dir, tmp_path / "recorded")
    (checkpoint / QUALITY_FILE).write_text(json.dumps({"serve": {"kernel": "native_f32"}}))
    with ServerProcess.start(checkpoint, "tiny") as server:
        log = server.log()
    assert "kernel native_f32: chosen by the checkpoint's build" in log
    assert plans(log) and all(line.endswith(": 1+ rows native_f32") for line in plans(log))
    with ServerProcess.start(checkpoint, "tiny", extra=["--kernel", "autotune"]) as server:
        assert "chosen by the checkpoint's build" not in server.log()
    with ServerProcess.start(checkpoint, "tiny", extra=["--kernel", "native_i8"]) as server:
        log = server.log()
    assert "chosen by the checkpoint's build" not in log
    assert plans(log) and all(line.endswith(": 1+ rows native_i8") for line in plans(log))


def test_an_unparseable_kv_transfer_config_stops_the_start(tiny_gptq_dir: Path) -> None:
    """KServe's spec.kvCacheOffloading passes vLLM's --kv-transfer-config: JSON that is not an
    object stops the start at once, in one line naming it, with exit code 2."""
    code, out = run_predictor(["--model-dir", str(tiny_gptq_dir), "--kv-transfer-config",
                               '{"kv_connector": OffloadingConnector}'])  # fmt: skip
    assert code == 2 and "predictor: --kv-transfer-config is not JSON" in out, out
    assert "Traceback" not in out
