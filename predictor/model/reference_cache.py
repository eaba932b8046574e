"""The fp reference's evaluation figures, kept in its own folder so they are computed once.

Scoring the fp32 source (perplexity on both texts, greedy answers to the prompts and its own
next-token choices on them) is the slowest part of a build's evaluation, and it is the same
every time: a new GPTQ checkpoint is compared with the same fp folder. The figures are stored
in `<reference>/reference.json` under a key made of everything they depend on (the weight and
config files' sizes and modification times, the texts, the settings, the library versions);
any change of those computes them again. A folder that cannot be written is simply not cached.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

CACHE_FILE = "reference.json"
VERSION = 1


def cache_key(
    reference: Path, texts: Mapping[str, Path], settings: Mapping[str, Any]
) -> dict[str, Any]:
    """What the reference's figures depend on, as plain JSON values."""
    files = sorted(
        [entry.name, entry.stat().st_size, entry.stat().st_mtime_ns]
        for pattern in ("*.safetensors", "*.bin", "config.json", "tokenizer.json")
        for entry in reference.glob(pattern)
    )
    digests = {name: hashlib.sha256(path.read_bytes()).hexdigest() for name, path in texts.items()}
    versions = {name: _version(name) for name in ("torch", "transformers")}
    return {
        "version": VERSION,
        "files": files,
        "texts": digests,
        "settings": dict(settings),
        "libraries": versions,
    }


def load(reference: Path, key: Mapping[str, Any]) -> dict[str, Any] | None:
    """The cached figures when the stored key equals `key`; None otherwise."""
    try:
        stored = json.loads((reference / CACHE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(stored, dict) or stored.get("key") != _plain(key):
        return None
    figures = stored.get("figures")
    return figures if isinstance(figures, dict) else None


def store(reference: Path, key: Mapping[str, Any], figures: Mapping[str, Any]) -> bool:
    """Write the figures beside the reference; False when the folder cannot be written."""
    target = reference / CACHE_FILE
    staged = target.with_suffix(".tmp")
    try:
        staged.write_text(json.dumps({"key": key, "figures": figures}) + "\n", encoding="utf-8")
        staged.replace(target)
    except OSError:
        return False
    return True


def _plain(value: Any) -> Any:
    """`value` as it reads back from JSON (tuples become lists)."""
    return json.loads(json.dumps(value))


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "none"


def as_sequences(value: Sequence[Sequence[Any]]) -> list[tuple[list[int], int]]:
    """Greedy sequences back from JSON: [[ids, prompt_length], ...]."""
    return [([int(i) for i in ids], int(length)) for ids, length in value]
