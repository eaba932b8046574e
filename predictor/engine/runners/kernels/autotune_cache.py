"""The autotune's choices on disk (autotune.py measures them): one JSON file per identity under
`--autotune-cache`, keyed by the CPU's model and flags, torch's version and what autotune.py adds
(the threads, the model's shapes, the candidates, `source_digest`: the C matmuls' sources). A
file made for another identity, or naming a kernel not available here, is not used; a file is
written whole or not at all (two servers may start at once). lora/tune.py's plan of LoRA's
modes is kept beside them the same way, so two servers on one machine run the same numerics."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from predictor.engine.runners.native import bindings as native

logger = logging.getLogger(__name__)


@dataclass
class Choices:
    """Per matmul ("qkv 960x576/32 x30", "lm_head 49152x576"): the kernel of each bucket, and
    what each candidate measured (ms a pass over the layers timed)."""

    plans: dict[str, list[tuple[int, str]]] = field(default_factory=dict)
    figures: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    source: str = "measured"  # or "cache <file>", or "forced"


def cpu_identity() -> dict[str, Any]:
    return {
        "cpu": native.cpu_model(),
        "flags": sorted(native.cpu_flags()),
        "torch": torch.__version__,
    }


def cache_key(identity: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def source_digest(files: tuple[Path, ...] | None = None) -> str:
    # the kernels' sources (the matmuls' by default) and the header their tile driver and
    # vector mappings live in
    files = (native.INT4_SOURCE, native.INT8_SOURCE) if files is None else files
    sources = b"".join(path.read_bytes() for path in (*files, native.HEADER))
    return hashlib.sha256(sources).hexdigest()[:16]


def cache_file(cache_dir: Path, key: str) -> Path:
    return cache_dir / f"autotune-{key[:24]}.json"


def read_cache(cache_dir: Path | None, key: str, identity: dict[str, Any]) -> Choices | None:
    if cache_dir is None:
        return None
    path = cache_file(cache_dir, key)
    try:
        data = json.loads(path.read_text())
        if data.get("identity") != json.loads(json.dumps(identity)):
            raise ValueError("made for another machine, torch or model")
        plans = {
            name: [(int(rows), str(kernel)) for rows, kernel in plan]
            for name, plan in data["plans"].items()
        }
        wanted = set(identity["groups"]) | {identity["head"][0]}
        if set(plans) != wanted or any(not plan or plan[0][0] != 1 for plan in plans.values()):
            raise ValueError("its plans do not cover this model")
        for name, plan in plans.items():
            allowed = identity["groups"].get(name) or identity["head"][2]
            if name in identity["groups"] and identity["forced"] != "auto":
                allowed = [identity["forced"]]
            if any(kernel not in allowed for _, kernel in plan):
                raise ValueError(f"{name} names a kernel not available here")
        return Choices(plans, data.get("figures", {}), source=f"cache {path}")
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as error:
        logger.info("autotune cache %s not used (%s): measuring again", path, error)
        return None


def write_cache(
    cache_dir: Path | None, key: str, identity: dict[str, Any], choices: Choices
) -> Choices:
    """Keeps `choices` for `identity` unless another server's were written first, and returns
    the choices kept: two servers that measured at once serve the same kernels."""
    data = {"identity": identity, "plans": choices.plans, "figures": choices.figures}
    kept = _settled(
        cache_dir, cache_file, key, data, lambda: read_cache(cache_dir, key, identity), choices
    )
    return choices if kept.plans == choices.plans else kept


T = TypeVar("T")


def _settled(
    cache_dir: Path | None,
    file: Callable[[Path, str], Path],
    key: str,
    data: dict[str, Any],
    read: Callable[[], T | None],
    mine: T,
) -> T:
    """`data` written to `file(cache_dir, key)` where no file is (a file that does not read back
    is replaced), and what the file then holds: the first of servers measuring at once wins."""
    if cache_dir is None:
        return mine
    path = file(cache_dir, key)
    if _write_whole(path, data, replace=False):
        kept = read()
        if kept is not None:
            return kept
        _write_whole(path, data, replace=True)
    return mine


def _write_whole(path: Path, data: dict[str, Any], replace: bool) -> bool:
    """Whether a file is at `path` now (ours, or another's where `replace` is false)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        try:  # whole or not at all, even with two servers starting at once
            if replace:
                os.replace(f.name, path)
            else:
                with contextlib.suppress(FileExistsError):
                    os.link(f.name, path)
        finally:
            Path(f.name).unlink(missing_ok=True)
        return True
    except OSError as error:
        logger.warning("autotune cache %s not written: %s", path, error)
        return False


def lora_file(cache_dir: Path, key: str) -> Path:
    return cache_dir / f"lora-{key[:24]}.json"


def read_lora_plan(
    cache_dir: Path | None, identity: dict[str, Any]
) -> list[tuple[int, str]] | None:
    """lora/tune.py's plan for `identity` (its modes among identity["modes"]), or None."""
    if cache_dir is None:
        return None
    path = lora_file(cache_dir, cache_key(identity))
    try:
        data = json.loads(path.read_text())
        if data.get("identity") != json.loads(json.dumps(identity)):
            raise ValueError("made for another machine, torch or model")
        plan = [(int(rows), str(mode)) for rows, mode in data["plan"]]
        if not plan or plan[0][0] != 1 or any(m not in identity["modes"] for _, m in plan):
            raise ValueError("its plan names a mode not available here")
        return plan
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as error:
        logger.info("lora cache %s not used (%s): measuring again", path, error)
        return None


def write_lora_plan(
    cache_dir: Path | None, identity: dict[str, Any], plan: list[tuple[int, str]]
) -> list[tuple[int, str]]:
    """As write_cache: the plan kept, ours or the first server's."""
    data = {"identity": identity, "plan": plan}
    return _settled(
        cache_dir,
        lora_file,
        cache_key(identity),
        data,
        lambda: read_lora_plan(cache_dir, identity),
        plan,
    )
