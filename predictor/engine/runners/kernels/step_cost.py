"""What a forward pass of so many tokens costs on this machine, from the autotune's figures:
the speculative-decoding policy (engine/speculation.py) asks it whether drafts pay."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

from predictor.engine.runners.kernels.autotune import (
    ALL_LAYERS_UP_TO,
    BUCKETS,
    FEW_LAYERS,
    Choices,
    _groups,
    _head_name,
    _sample,
)
from predictor.engine.runners.kernels.int4_linear import Int4Linear


def step_cost(
    choices: Choices, linears: Sequence[Int4Linear], names: Sequence[str], head: Any
) -> Callable[[int, int], float] | None:
    """Seconds the matmuls of a forward pass take for `fed` tokens returning `logit_rows`
    rows of logits, from what the autotune measured of each matmul's chosen kernels (per
    layer, times the layers of each shape; between two measured row counts, a straight line;
    past the last, its slope). None where a matmul has no figures (a forced kernel)."""
    layers, head_name = _groups(linears, names), _head_name(head)
    curves: list[tuple[list[tuple[int, float]], int, bool]] = []  # (points, layers, per logit)
    for key, plan in choices.plans.items():
        figures = choices.figures.get(key)
        if not figures:
            return None
        group = layers.get(key)
        timed = len(_sample(group)) if group else 1
        points = []
        for rows in BUCKETS:
            kernel = next(name for start, name in reversed(plan) if start <= rows)
            seconds = figures.get(str(rows), {}).get(kernel)
            if seconds is None:
                return None
            per_layer = timed if rows <= ALL_LAYERS_UP_TO or not group else min(FEW_LAYERS, timed)
            points.append((rows, seconds / 1e3 / per_layer))
        curves.append((points, len(group) if group else 1, key == head_name))

    def cost(fed: int, logit_rows: int) -> float:
        total = 0.0
        for points, count, head in curves:
            total += count * _interpolate(points, max(1, logit_rows if head else fed))
        return total

    return cost


def _interpolate(points: list[tuple[int, float]], rows: int) -> float:
    for (r0, t0), (r1, t1) in itertools.pairwise(points):
        if rows <= r1:
            return t0 + (t1 - t0) * (rows - r0) / (r1 - r0)
    (r0, t0), (r1, t1) = points[-2], points[-1]
    return t1 + (t1 - t0) * (rows - r1) / (r1 - r0)
