"""The process environment the model tools (quantize, evaluate) set before importing gptqmodel."""

from __future__ import annotations

from collections.abc import MutableMapping
from pathlib import Path


def prepare_environment(env: MutableMapping[str, str], hf_home: Path) -> None:
    """Cache and worker variables gptqmodel would otherwise point at /tmp or oversubscribe."""
    env.setdefault("HF_HOME", str(hf_home))
    env.setdefault("HF_HUB_OFFLINE", "1")
    # 2 whatever the cores: gptqmodel's model-loader pool asks its parent for 2 workers and
    # fails with 1 ("requests 2 workers but parent 'cpu' only has 1"); more oversubscribe 2 cores
    env.setdefault("GPTQMODEL_CPU_WORKERS", "2")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
