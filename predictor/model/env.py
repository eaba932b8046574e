"""The process environment the model tools (quantize, evaluate) set before importing gptqmodel."""

from __future__ import annotations

from collections.abc import MutableMapping
from pathlib import Path

from predictor.model import internals


def prepare_environment(env: MutableMapping[str, str], hf_home: Path) -> None:
    """Cache and worker variables gptqmodel would otherwise point at /tmp or oversubscribe."""
    env.setdefault("HF_HOME", str(hf_home))
    env.setdefault("HF_HUB_OFFLINE", "1")
    # 2 whatever the cores: gptqmodel's model-loader pool asks its parent for 2 workers and
    # fails with 1 ("requests 2 workers but parent 'cpu' only has 1"); more oversubscribe 2 cores
    env.setdefault("GPTQMODEL_CPU_WORKERS", "2")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    # pack in torch rather than compile gptqmodel's C++ packing extension on a machine's first
    # build: 35-40 s against 0.6 s (2-core Xeon, AVX2 held); the checkpoint is the same
    env.setdefault(internals.PACK_EXTENSION_OFF, "1")
