"""Which mode LoRA's native kernel (layer_ops.c's lora_add) runs at each row-count bucket,
measured on this machine at start as autotune.py measures the matmuls' kernels: bf16 factors
with fp32 sums, or int8 factors and activations where the CPU has AVX-512 VNNI (lora.py, MODES).
Timed only where adapters will be served (--lora-modules, --allow-runtime-lora): a fraction of a
second, cached beside the matmuls' choices (autotune_cache.py): the modes' numerics differ, and
two servers on one machine (replicas, an adapter given at start and one loaded later) must give
the same tokens for the same request.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any

import torch

from predictor.engine.runners.kernels.autotune import ALL_LAYERS_UP_TO, BUCKETS, FEW_LAYERS, REPEATS
from predictor.engine.runners.kernels.autotune_cache import (
    cpu_identity,
    read_lora_plan,
    source_digest,
    write_lora_plan,
)
from predictor.engine.runners.lora.weights import GROUPS, Factors, LoraWeights
from predictor.engine.runners.native import bindings as native

logger = logging.getLogger(__name__)


LORA_RANK = 16  # the adapters' rank lora_add's modes are timed with (a typical fine-tune's)


VERSION = 1  # of the cache file's contents and the choosing rule


def tune(
    weights: LoraWeights, invariant: bool = False, threads: int = 1, cache_dir: Path | None = None
) -> list[tuple[int, str]]:
    """lora_add's mode per row-count bucket (lora.py's MODES), timed here on an adapter of rank
    LORA_RANK on every projection of every layer (random factors; the time depends on shapes
    only): bf16 factors with fp32 sums, or int8 factors and activations where the kernel has
    them (AVX-512 VNNI). `invariant` (--batch-invariant): one mode at every row count (a row's
    bits may not depend on how many rows share its step), the fastest over the buckets.
    Installs the plan on `weights` and returns it. A pass takes a fraction of a second; the plan
    is read back from `cache_dir` where one was made for this identity."""
    modes = ["bf16", "int8"] if weights.kernel.lora_int8 else ["bf16"]  # timed even alone: the log
    identity = {
        "version": VERSION,
        **cpu_identity(),
        "threads": threads,
        "invariant": invariant,
        "layers": weights.layers,
        "shapes": {module: list(shape) for module, shape in sorted(weights.shapes.items())},
        "modes": modes,
        "source": source_digest((native.LAYER_SOURCE,)),  # lora_add
    }
    cached = read_lora_plan(cache_dir, identity)
    if cached is not None:
        weights.plan = cached
        logger.info("kernel lora (cache): %s", _described(cached))
        return cached
    measured = _measure(weights, modes, invariant)
    plan = write_lora_plan(cache_dir, identity, measured)
    if plan != measured:  # another server measured at once and wrote first
        weights.plan = plan
        logger.info("kernel lora (cache, written at once by another server): %s", _described(plan))
    return plan


def _described(plan: list[tuple[int, str]]) -> str:
    return ", ".join(f"{rows}+ rows {mode}" for rows, mode in plan)


def _measure(weights: LoraWeights, modes: list[str], invariant: bool) -> list[tuple[int, str]]:
    generator = torch.Generator().manual_seed(0)
    factors: Factors = {
        (layer, module): (
            torch.randn(LORA_RANK, features_in, generator=generator) * 0.02,
            torch.randn(features_out, LORA_RANK, generator=generator) * 0.02,
        )
        for layer in range(weights.layers)
        for module, (features_in, features_out) in weights.shapes.items()
    }
    probe = LoraWeights(weights.shapes, weights.layers, weights.device)
    probe.kernel = weights.kernel
    figures: dict[int, dict[str, float]] = {rows: {} for rows in BUCKETS}
    for mode in modes:
        probe.plan = [(1, mode)]
        probe.add(1, factors, 1.0)
        for rows in BUCKETS:
            figures[rows][mode] = _time(probe, rows)
        probe.remove(1)
    if invariant:  # of the modes whose rows come out the same in any company, here
        probe.add(1, factors, 1.0)
        kept = [mode for mode in modes if _row_invariant(probe, mode, generator)]
        probe.remove(1)
        for mode in sorted(set(modes) - set(kept)):
            logger.warning("autotune: lora %s mode is not row-invariant here: not used", mode)
        best = min(kept or modes, key=lambda mode: sum(timed[mode] for timed in figures.values()))
        plan = [(1, best)]
    else:
        plan = []
        for rows, timed in figures.items():
            best = min(timed, key=timed.__getitem__)
            if not plan or plan[-1][1] != best:
                plan.append((rows, best))
    for rows, timed in figures.items():
        ranked = ", ".join(f"{mode} {seconds * 1e3:.3f}" for mode, seconds in timed.items())
        logger.info("autotune lora rank %d at %d rows (ms a pass): %s", LORA_RANK, rows, ranked)
    weights.plan = plan
    logger.info("kernel lora: %s", _described(plan))
    return plan


def _time(weights: LoraWeights, rows: int) -> float:
    """Seconds one pass of lora_add over every layer's projection groups takes at `rows` rows of
    the one adapter (all layers up to ALL_LAYERS_UP_TO rows, then FEW_LAYERS), fastest of
    REPEATS after a warm pass."""
    step = weights.step([1] * rows)
    assert step is not None
    calls = []
    for group, modules in GROUPS.items():
        present = [m for m in modules if m in weights.shapes]
        if not present:
            continue
        x = torch.randn(rows, weights.shapes[present[0]][0]).to(torch.bfloat16)
        out = torch.zeros(rows, sum(weights.shapes[m][1] for m in present), dtype=torch.bfloat16)
        calls.append((group, x, out))
    layers = range(weights.layers if rows <= ALL_LAYERS_UP_TO else min(FEW_LAYERS, weights.layers))

    def one_pass() -> None:
        for layer in layers:
            for group, x, out in calls:
                weights.apply(layer, group, x, out, step)

    one_pass()
    best = math.inf
    for _ in range(REPEATS):
        start = time.perf_counter()
        one_pass()
        best = min(best, time.perf_counter() - start)
    return best * weights.layers / len(layers)


@torch.inference_mode()
def _row_invariant(weights: LoraWeights, mode: str, generator: torch.Generator) -> bool:
    """Whether `mode` gives each row of every projection group the same bits alone and beside
    1 to 12 other rows of the adapter in slot 1 (a kernel's instances for other row counts may
    round differently: a compiler's choice, so checked on this machine's build)."""
    weights.plan = [(1, mode)]
    for group, modules in GROUPS.items():
        present = [m for m in modules if m in weights.shapes]
        if not present:
            continue
        width = sum(weights.shapes[m][1] for m in present)
        x = (torch.randn(13, weights.shapes[present[0]][0], generator=generator) * 2).bfloat16()
        out = (torch.randn(13, width, generator=generator)).bfloat16()
        alone = [
            weights.apply(0, group, x[i : i + 1], out[i : i + 1].clone(), _step(weights, 1))
            for i in range(13)
        ]
        for rows in (2, 3, 4, 5, 9, 13):
            together = weights.apply(0, group, x[:rows], out[:rows].clone(), _step(weights, rows))
            if not all(torch.equal(together[i], alone[i][0]) for i in range(rows)):
                return False
    return True


def _step(weights: LoraWeights, rows: int) -> Any:
    step = weights.step([1] * rows)
    assert step is not None
    return step
