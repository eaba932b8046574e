"""Where the checkpoint is inside a model folder, in the layouts KServe's storage initializer makes.

`storageUri` is copied into /mnt/models as it is stored: the checkpoint's own files (an `hf://`
repository, an `s3://` prefix that points at the checkpoint), or one folder holding them (a prefix
that points at its parent, an unpacked `.tar.gz` or `.zip` of the folder, a modelcar image that
keeps it under one directory). Hidden entries (`.cache` from an `hf://` download, `.gitattributes`)
and a volume's `lost+found` are not model folders. No torch here: this runs before loading.
"""

from __future__ import annotations

from pathlib import Path

from predictor.errors import CheckpointError

CONFIG_FILE = "config.json"
NOT_MODEL_FOLDERS = frozenset({"lost+found"})


def resolve_checkpoint_dir(path: Path) -> Path:
    """The folder holding the checkpoint: `path` itself, or its only sub-folder holding one.

    A path that is neither comes back unchanged, so the loader names what is missing; several
    sub-folders holding a checkpoint are an error, since guessing would serve the wrong model.
    """
    if (path / CONFIG_FILE).is_file() or not path.is_dir():
        return path
    candidates = sorted(
        entry
        for entry in path.iterdir()
        if entry.is_dir()
        and not entry.name.startswith(".")
        and entry.name not in NOT_MODEL_FOLDERS
        and (entry / CONFIG_FILE).is_file()
    )
    if len(candidates) > 1:
        names = ", ".join(entry.name for entry in candidates)
        raise CheckpointError(
            f"{path} holds several checkpoints ({names}): point --model-dir at one of them"
        )
    return candidates[0] if candidates else path


def served_name(model_name: str, model_dir: Path) -> str:
    """The name the model is served under: `--model-name`, else the checkpoint folder's name
    (the folder `resolve_checkpoint_dir` finds, not the mount point above it)."""
    return model_name or resolve_checkpoint_dir(model_dir).absolute().name
