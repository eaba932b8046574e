"""The autotune's choices on disk (autotune.py measures them): one JSON file per identity under
`--autotune-cache`, keyed by the CPU's model and flags, torch's version and what autotune.py adds
(the threads, the model's shapes, the candidates, `source_digest`: the C matmuls' sources). A
file made for another identity, or naming a kernel not available here, is not used; a file is
written whole or not at all (two servers may start at once)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from predictor.engine.runners import native

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


def source_digest() -> str:
    # the matmuls' sources and the header their tile driver and vector mappings live in
    files = (native.INT4_SOURCE, native.INT8_SOURCE, native.HEADER)
    sources = b"".join(path.read_bytes() for path in files)
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
) -> None:
    if cache_dir is None:
        return
    path = cache_file(cache_dir, key)
    data = {"identity": identity, "plans": choices.plans, "figures": choices.figures}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(f.name, path)  # whole or not at all, even with two servers starting at once
    except OSError as error:
        logger.warning("autotune cache %s not written: %s", path, error)
