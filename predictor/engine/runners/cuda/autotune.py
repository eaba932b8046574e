"""Which kernel serves each GPU projection, per row-count bucket, measured on this GPU at start.

As on the CPU (kernels/autotune.py), nothing is a constant: for each projection shape and the
first row count of each bucket, every candidate (cuda/linear.py) first computes the shape's first
layer on random activations and is dropped, with a warning, if it disagrees with the dense
reference (a kernel whose layout or arithmetic moved in another torch); then one pass over
every layer of the shape is captured in a CUDA graph and replayed, so the figure is the kernels'
own time as a decode step's graph runs them (no launch cost from Python, weights read from
memory as a step reads them, not from the L2 cache), and the fastest serves the bucket.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from predictor.engine.runners.cuda.linear import DENSE, CudaLinear

logger = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
REPLAYS = 7  # timed replays of a pass; the median counts
# A candidate must agree with the dense reference to this relative error (bf16 activations:
# ~4e-3 between two correct kernels here; a wrong layout is near 1)
TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 3e-2, torch.float32: 1e-4}
# The dense kernel keeps a copy of the weights in the activations' dtype (4x the 4-bit bytes):
# it serves a bucket only when this much faster than the best 4-bit kernel, a policy on memory
DENSE_MARGIN = 1.15


@dataclass
class GpuChoices:
    """Per projection shape ("qkv 960x576/32 4-bit x30"): the kernel of each bucket, and what
    each candidate measured (microseconds a pass over the shape's layers)."""

    plans: dict[str, list[tuple[int, str]]] = field(default_factory=dict)
    figures: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    dropped: dict[str, str] = field(default_factory=dict)  # candidate -> why


def _groups(linears: Sequence[CudaLinear], names: Sequence[str]) -> dict[str, list[CudaLinear]]:
    grouped: dict[str, list[CudaLinear]] = {}
    for layer, name in zip(linears, names, strict=True):
        n, k, g, bits = layer.shape
        order = " act-order" if layer.perm is not None else ""
        grouped.setdefault(f"{name} {n}x{k}/{g} {bits}-bit{order}", []).append(layer)
    return {f"{key} x{len(group)}": group for key, group in grouped.items()}


def tune(linears: Sequence[CudaLinear], names: Sequence[str], max_rows: int) -> GpuChoices:
    """Measure, choose and install a plan on every layer (named by kind: qkv, o, ...)."""
    choices = GpuChoices()
    buckets = [b for b in BUCKETS if b <= max(1, max_rows)]
    for key, group in _groups(linears, names).items():
        plan, figures = _measure(key, group, buckets, choices.dropped)
        choices.plans[key], choices.figures[key] = plan, figures
        for layer in group:
            layer.use(plan)
            layer.release_weights()
    torch.cuda.empty_cache()
    return choices


def _measure(
    key: str, group: list[CudaLinear], buckets: list[int], dropped: dict[str, str]
) -> tuple[list[tuple[int, str]], dict[str, dict[str, float]]]:
    first = group[0]
    device = first.qweight.device
    generator = torch.Generator(device=device).manual_seed(0)
    reference = first.kernel(DENSE)
    plan: list[tuple[int, str]] = []
    figures: dict[str, dict[str, float]] = {}
    for rows in buckets:
        x = torch.randn((rows, first.in_features), generator=generator, device=device)
        x = x.to(first.dtype)
        expected = reference(x).float()
        timed: dict[str, float] = {}
        for name in first.candidates(rows):
            if f"{key}: {name}" in dropped:
                continue
            try:
                for layer in group:
                    layer.kernel(name)
                got = first.kernel(name)(x).float()
            except Exception as failure:  # a kernel this GPU or torch cannot build or run
                dropped[f"{key}: {name}"] = f"{type(failure).__name__}: {failure}"
                logger.warning("GPU kernel %s dropped for %s: %s", name, key, failure)
                continue
            error = float((got - expected).norm() / expected.norm().clamp_min(1e-30))
            if not error < TOLERANCE[first.dtype]:
                dropped[f"{key}: {name}"] = f"relative error {error:.2e} against dense"
                logger.warning("GPU kernel %s dropped for %s: error %.2e", name, key, error)
                continue
            timed[name] = _time_pass([layer.kernel(name) for layer in group], x)
        if not timed:
            raise RuntimeError(f"no GPU kernel serves {key} at {rows} rows")
        best4 = min((t, n) for n, t in timed.items() if n != DENSE) if len(timed) > 1 else None
        best = min((t, n) for n, t in timed.items())
        if best[1] == DENSE and best4 is not None and best4[0] <= best[0] * DENSE_MARGIN:
            best = best4
        figures[str(rows)] = timed
        if not plan or plan[-1][1] != best[1]:
            plan.append((rows if plan else 1, best[1]))
    return plan, figures  # `use` keeps only the chosen kernels: the others are freed


def _time_pass(kernels: list[object], x: torch.Tensor) -> float:
    """Microseconds one pass of `kernels` over `x` takes, replayed from a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for kernel in kernels:  # warm: compiled, allocated
            kernel(x)  # type: ignore[operator]
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for kernel in kernels:
            kernel(x)  # type: ignore[operator]
    graph.replay()
    times = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    del graph
    return statistics.median(times)


def log_choices(choices: GpuChoices) -> None:
    for key, plan in choices.plans.items():
        steps = ", ".join(f"{rows}+ rows: {name}" for rows, name in plan)
        logger.info("GPU kernels for %s: %s", key, steps)
    for what, why in choices.dropped.items():
        logger.info("GPU kernel not used: %s (%s)", what, why)
