"""The layouts KServe's storage initializer leaves in /mnt/models, resolved to the checkpoint.

The server itself loading a nested layout is proven by tests/deploy/test_metric_names.py, which
starts it the way the ClusterServingRuntime does, on the tiny checkpoint one folder down.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from predictor.errors import CheckpointError
from predictor.model.layout import resolve_checkpoint_dir


def checkpoint(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (folder / "model.safetensors").write_bytes(b"")
    return folder


def test_the_checkpoint_itself(tmp_path: Path) -> None:
    # hf:// or an s3:// prefix naming the checkpoint: its files land in /mnt/models
    models = checkpoint(tmp_path / "models")
    (models / ".cache").mkdir()  # hf:// downloads leave one
    assert resolve_checkpoint_dir(models) == models


def test_one_folder_down(tmp_path: Path) -> None:
    # an s3:// prefix naming the parent, an unpacked archive of the folder, a modelcar
    models = tmp_path / "models"
    inner = checkpoint(models / "smollm2-135m-instruct-gptq")
    (models / ".cache" / "x").mkdir(parents=True)
    (models / "lost+found").mkdir()
    (models / "README.md").write_text("stray files beside the folder do not matter")
    assert resolve_checkpoint_dir(models) == inner


def test_hidden_and_volume_folders_are_never_the_model(tmp_path: Path) -> None:
    models = tmp_path / "models"
    checkpoint(models / ".snapshot")
    checkpoint(models / "lost+found")
    assert resolve_checkpoint_dir(models) == models  # the loader then says what is missing


def test_two_checkpoints_are_refused(tmp_path: Path) -> None:
    models = tmp_path / "models"
    checkpoint(models / "a")
    checkpoint(models / "b")
    with pytest.raises(CheckpointError, match=r"several checkpoints \(a, b\)"):
        resolve_checkpoint_dir(models)


def test_two_levels_down_is_not_searched(tmp_path: Path) -> None:
    models = tmp_path / "models"
    checkpoint(models / "outer" / "inner")
    assert resolve_checkpoint_dir(models) == models


@pytest.mark.parametrize("kind", ["missing", "empty", "file"])
def test_nothing_to_resolve_comes_back_unchanged(kind: str, tmp_path: Path) -> None:
    path = tmp_path / "models"
    if kind == "empty":
        path.mkdir()
    elif kind == "file":
        path.write_text("not a folder")
    assert resolve_checkpoint_dir(path) == path


def test_a_symlinked_folder_is_followed(tmp_path: Path) -> None:
    # a modelcar's /mnt/models is a link into the model image's filesystem
    inner = checkpoint(tmp_path / "image" / "models" / "gptq")
    link = tmp_path / "mnt-models"
    link.symlink_to(tmp_path / "image" / "models")
    assert resolve_checkpoint_dir(link) == link / inner.name
