"""The process environment the model tools (quantize, evaluate) set before importing gptqmodel,
and the machine they name in their reports."""

from __future__ import annotations

import contextlib
import os
import platform
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
    # build: the compile costs far more than torch's packing; the checkpoint is the same
    env.setdefault(internals.PACK_EXTENSION_OFF, "1")


def cpu_name() -> str:
    """The CPU's model name and widest vector unit ("AMD EPYC, AVX-512"); the platform otherwise."""
    name, flags = "", set[str]()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not name:
                name = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    vector = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else ""
    name = name or platform.processor() or platform.machine()
    held = _torch_held_to(vector)
    name = f"{name}, {vector}" if vector else name
    return f"{name} (torch held to {held})" if held else name


def _torch_held_to(vector: str) -> str:
    """The ISA torch's kernels use when ATEN_CPU_CAPABILITY holds them below the CPU's, or ""."""
    if "ATEN_CPU_CAPABILITY" not in os.environ:
        return ""
    import torch

    names = {"AVX512": "AVX-512", "AVX2": "AVX2"}
    used = names.get(str(torch.backends.cpu.get_cpu_capability()), "no vector ISA")
    return used if used != vector else ""
