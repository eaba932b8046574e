"""The GPU runner's tests: marked `cuda` (the device script runs `pytest -m cuda`), skipped where
there is no GPU, so `make test` on a CPU is unchanged. The kernel tests also run on a CPU under
Triton's interpreter (`TRITON_INTERPRET=1 pytest tests/engine/runners/cuda -k triton`), where
Triton is installed: slow, but it checks a kernel's arithmetic before any GPU time is spent."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch


@pytest.fixture(scope="session")
def gpu() -> torch.device:
    """The GPU, or skip (no GPU, no Triton)."""
    if torch.cuda.is_available() and importlib.util.find_spec("triton") is not None:
        return torch.device("cuda")
    pytest.skip("needs a CUDA GPU and Triton")


@pytest.fixture(scope="session")
def kernel_device() -> torch.device:
    """Where the Triton kernels run: the GPU, or the CPU under TRITON_INTERPRET=1, or skip."""
    if torch.cuda.is_available() and importlib.util.find_spec("triton") is not None:
        return torch.device("cuda")
    if os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton"):
        return torch.device("cpu")
    pytest.skip("needs a CUDA GPU and Triton (or TRITON_INTERPRET=1 with Triton installed)")
