"""The process environment the model tools (quantize, evaluate) set before importing gptqmodel."""

from __future__ import annotations

from collections.abc import MutableMapping
from pathlib import Path


def prepare_environment(env: MutableMapping[str, str], hf_home: Path, cores: int) -> None:
    """Cache and worker variables gptqmodel would otherwise point at /tmp or oversubscribe."""
    env.setdefault("HF_HOME", str(hf_home))
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("GPTQMODEL_CPU_WORKERS", str(max(1, min(cores, 2))))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
