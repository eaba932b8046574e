"""engine/runners/kernels/layout_store.py: the native kernels' layouts kept on disk. A second runner of
the same weights maps every layout it built (the same logits); other weights, a file of the wrong
size or an unwritable folder build afresh; the folder stays under its bound."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from predictor.engine.runners.kernels.layout_store import FOLDER, LayoutStore, fingerprint
from predictor.engine.runners.native import bindings as native
from predictor.engine.step import StepRow


def test_the_fingerprint_follows_every_block_of_the_bytes_and_the_facts() -> None:
    weights = torch.randint(-(2**31), 2**31 - 1, (300, 100), dtype=torch.int32)
    same = fingerprint([weights.clone(), None], "int4", (1, 2))
    assert fingerprint([weights, None], "int4", (1, 2)) == same
    changed = weights.clone()
    changed[150, 3] += 1  # one word of one block
    assert fingerprint([changed, None], "int4", (1, 2)) != same
    tail = weights.clone()
    tail.view(-1)[-1] += 1  # past the last whole block
    assert fingerprint([tail, None], "int4", (1, 2)) != same
    assert fingerprint([weights, None], "int4", (1, 3)) != same
    assert fingerprint([weights.view(100, 300), None], "int4", (1, 2)) != same


def test_a_layout_is_read_back_at_its_size_only_and_the_folder_kept_under_its_bound(
    tmp_path: Path,
) -> None:
    store = LayoutStore(tmp_path, max_bytes=2500)
    layout = torch.arange(1000, dtype=torch.int32).view(torch.uint8)[:1000]
    store.write("a", layout)
    read = store.read("a", 1000)
    assert read is not None and torch.equal(read, layout) and store.read_bytes == 1000
    assert store.read("a", 999) is None and store.read("missing", 1000) is None
    old = tmp_path / FOLDER / "a.bin"
    os.utime(old, (1, 1))  # least recently used
    store.write("b", layout)
    store.write("c", layout)  # 3000 bytes past 2500: "a" goes
    assert sorted(p.name for p in (tmp_path / FOLDER).iterdir()) == ["b.bin", "c.bin"]
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    LayoutStore(blocked).write("d", layout)  # logged, not raised


def runner(model: Any, cache: Path) -> Any:
    from predictor.engine.runners.cpu import ModelRunner

    made = ModelRunner(model, torch.device("cpu"), 64, 16, autotune_cache=cache)
    made.bind_thread()
    return made


def test_a_second_runner_maps_the_layouts_the_first_built(
    tiny_gptq_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from predictor.model.loader import load_checkpoint

    if not native.usable_isas():
        pytest.skip("no native matmuls here (neither AVX2 + FMA nor AVX-512)")
    rows = [StepRow([0], 0, [5, 6, 7, 8], True)]
    with caplog.at_level("INFO", logger="predictor.engine.runners.kernels.matmuls"):
        first = runner(load_checkpoint(tiny_gptq_dir, device="cpu", threads=1).model, tmp_path)
        logits = first.forward(rows)
        files = sorted((tmp_path / FOLDER).glob("*.bin"))
        assert files, caplog.text  # the int4 layers' layouts (and the head's int8 copy)
        written = [r.getMessage() for r in caplog.records if "kernel layouts" in r.getMessage()]
        assert written and "0.00 GB mapped" in written[-1]
        caplog.clear()
        second = runner(load_checkpoint(tiny_gptq_dir, device="cpu", threads=1).model, tmp_path)
        assert torch.equal(second.forward(rows), logits)
        mapped = [r.getMessage() for r in caplog.records if "kernel layouts" in r.getMessage()]
        assert (
            mapped and mapped[-1].endswith("0.00 GB written") and "0.00 GB mapped" not in mapped[-1]
        )
    assert sorted((tmp_path / FOLDER).glob("*.bin")) == files
