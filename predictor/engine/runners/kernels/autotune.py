"""Which kernel runs each matmul, per row-count bucket, measured on this machine at start.

The fastest kernel for a fused int4 projection (int4_linear.py) or for lm_head depends on
the CPU (AVX2 or AVX-512, VNNI, whether oneDNN's bf16 path accepts it), the thread count and the
rows a step feeds: a 1-row step reads every weight once and little else, a 16-row step or a
prompt chunk is bound by arithmetic. So nothing here is a constant: every candidate is timed on
the model's own weights (all layers of a shape at few rows, where a step is bound by reading
them and cache residency matters; a few layers at many rows) at the first row count of each
bucket, and the fastest serves the bucket. A pass over all buckets takes a few seconds; its
choices are cached on disk (autotune_cache.py), keyed by the CPU model and flags, torch's
version, the threads, the model's shapes, the candidates and the C kernel's source, so a restart
on the same machine reads them back and a different machine (or torch, or model) measures again.
Its figures also say what a forward pass of so many tokens costs here (`step_cost`).
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from predictor.engine.runners.kernels.autotune_cache import (
    Choices,
    cache_key,
    cpu_identity,
    read_cache,
    source_digest,
    write_cache,
)
from predictor.engine.runners.kernels.copies import held_bytes, is_copy, pick, within_budget
from predictor.engine.runners.kernels.head_linear import head_candidates
from predictor.engine.runners.kernels.int4_linear import Int4Linear, Kernel
from predictor.engine.runners.kernels.invariance import ROWWISE, row_invariant, rowwise
from predictor.engine.runners.kernels.layout_store import LayoutStore
from predictor.engine.runners.native import bindings as native

logger = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # fewest rows of each bucket; the last takes any more
VERSION = 8  # of the cache file's contents and the choosing rule (8: the copies' margin in
# one kernel for every row count too)
ALL_LAYERS_UP_TO = 8  # rows: up to here every sampled layer is timed (memory-bound steps)
FEW_LAYERS = 4  # past it, this many
# The layers of a shape timed: all of them up to this many bytes of 4-bit weights (8x a core's
# L2 here: a pass reads them from the last-level cache or memory, as a step does), then no more:
# at 1-8B shapes a shape's layers hold 100-500 MB, and building every candidate for each (bf16
# expansions included) made the autotune of a 1.7B model take 181 s
SAMPLE_BYTES = 32 << 20
REPEATS = 3  # timed passes per figure; the fastest counts (the machine is shared and noisy)
# A candidate stops being timed after a pass that leaves its fastest this many times slower
# than the fastest finished one at that row count: its remaining passes could not make it win
# (nor come within COPY_MARGIN of the winner). Candidates run fastest first, by the last bucket.
CUT = 2.0


def _groups(linears: Sequence[Int4Linear], names: Sequence[str]) -> dict[str, list[Int4Linear]]:
    grouped: dict[str, list[Int4Linear]] = {}
    for layer, name in zip(linears, names, strict=True):
        n, k, g = layer.shape
        grouped.setdefault(f"{name} {n}x{k}/{g}", []).append(layer)
    return {f"{key} x{len(group)}": group for key, group in grouped.items()}


def tune(
    linears: Sequence[Int4Linear],
    names: Sequence[str],
    head: Any,
    threads: int,
    cache_dir: Path | None,
    forced: str = "auto",
    invariant: bool = False,
    defer_copies: bool = False,
    layouts: LayoutStore | None = None,
    copy_budget: int | None = None,
    head_replaced: bool = False,
) -> tuple[Choices, Kernel, list[Deferred]]:
    """Choose and install a plan on every layer of `linears` (named by kind: qkv, o, ...), and
    the lm_head kernel; returns the choices, the head's per-bucket dispatcher and what was
    deferred. `forced`: a fused kernel name every projection uses at every row count (only
    lm_head is measured). `invariant` (--batch-invariant): each matmul gets one kernel for
    every row count, among those whose rows come out the same whatever rows share the call
    (checked here, on this machine); where none is, one called a row at a time.
    `defer_copies`: the layers get their plans without the buckets of kernels that hold a copy
    of the weights (`lean`), to be completed by `complete` (the runner: after the server is
    ready, on a thread of its own). At 1.7B shapes the bf16 copies are 3.4 GB, most of a
    restart's 20 s; a step meanwhile runs its rows on the kernel of the bucket below.
    `layouts`: where the head's int8 copy is kept on disk (the layers carry their own).
    `copy_budget`: bytes the copies of the weights may keep in all (copies.py; None: no bound);
    `head_replaced`: the head's int8 table, where it serves, replaces the head's own weights."""
    groups = _groups(linears, names)
    heads = head_candidates(head, layouts)
    if invariant:
        heads |= {ROWWISE + name: _rowwise_factory(make) for name, make in heads.items()}
    weight = getattr(head, "weight", None)
    head_name = _head_name(head)
    identity = {
        "version": VERSION,
        **cpu_identity(),
        "threads": threads,
        "forced": forced,
        "invariant": invariant,
        "groups": {
            key: _with_rowwise(group[0].candidates(), invariant) for key, group in groups.items()
        },
        "head": [head_name, str(getattr(weight, "dtype", "")), sorted(heads)],
        "source": source_digest(),
    }
    key = cache_key(identity)
    cached = read_cache(cache_dir, key, identity)
    if cached is not None:
        choices = cached
    else:
        choices = write_cache(
            cache_dir, key, identity, _measure(groups, heads, head_name, forced, invariant)
        )
    sizes = {key: (*group[0].shape[:2], len(group)) for key, group in groups.items()}
    if weight is not None:
        sizes[head_name] = (int(weight.shape[0]), int(weight.shape[1]), 1)
    replaced = {head_name} if head_replaced else set()
    if copy_budget is not None:
        for dropped in within_budget(choices, sizes, copy_budget, invariant, replaced):
            logger.info("autotune: %s dropped: past the copies' budget", dropped)
    logger.info(
        "kernels' copies of the weights: %.0f MB (budget %s)",
        held_bytes(choices, sizes, replaced) / 1e6,
        "none" if copy_budget is None else f"{copy_budget / 1e6:.0f} MB",
    )
    defer = defer_copies and not invariant
    deferred: list[Deferred] = []
    for name, group in groups.items():
        plan = choices.plans[name]
        now = lean(plan) if defer else plan
        for layer in group:
            layer.use(now, final=now == plan)
            if now != plan:
                deferred.append((layer, plan))
    head_plan = choices.plans[head_name]
    built: dict[str, Kernel] = {}

    def head_kernel(plan: list[tuple[int, str]]) -> Kernel:
        for _, name in plan:
            if name not in built:
                built[name] = heads[name]()
        return _dispatch([(rows, built[name]) for rows, name in plan])

    head_now = lean(head_plan) if defer else head_plan
    if head_now != head_plan:
        deferred.append((head_kernel, head_plan))
    return choices, head_kernel(head_now), deferred


# what `tune` deferred: a layer (or the head's builder) and the plan it is to complete
Deferred = tuple[Int4Linear | Callable[[list[tuple[int, str]]], Kernel], list[tuple[int, str]]]


def lean(plan: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """`plan` without the buckets of kernels that hold a copy of the weights past its first:
    their rows run on the kernel below them."""
    kept: list[tuple[int, str]] = []
    for rows, name in plan:
        if kept and (is_copy(name) or name == kept[-1][1]):
            continue
        kept.append((rows, name))
    return kept


def complete(deferred: Sequence[Deferred]) -> Kernel | None:
    """Build what `tune` deferred and switch each layer to its whole plan; the head's whole
    dispatcher where it was deferred too."""
    head = None
    for layer, plan in deferred:
        if isinstance(layer, Int4Linear):
            layer.use(plan)
        else:
            head = layer(plan)
    return head


def _with_rowwise(names: list[str], invariant: bool) -> list[str]:
    return names + [ROWWISE + name for name in names] if invariant else names


def _rowwise_factory(make: Callable[[], Kernel]) -> Callable[[], Kernel]:
    return lambda: rowwise(make())


def _dispatch(plan: list[tuple[int, Kernel]]) -> Kernel:
    if len({id(k) for _, k in plan}) == 1:
        return plan[0][1]
    lows = [rows for rows, _ in plan]
    kernels = [kernel for _, kernel in plan]

    def run(x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        index = sum(1 for low in lows if low <= rows) - 1
        return kernels[max(index, 0)](x)

    return run


def _measure(
    groups: dict[str, list[Int4Linear]],
    heads: dict[str, Callable[[], Kernel]],
    head_name: str,
    forced: str,
    invariant: bool = False,
) -> Choices:
    choices = Choices(source="forced" if forced != "auto" else "measured")
    started = time.perf_counter()
    generator = torch.Generator().manual_seed(0)
    for key, group in groups.items():
        if forced != "auto":
            group[0].kernel(forced)  # raises here, naming why, if it cannot run
            choices.plans[key] = [(1, forced)]
            continue
        candidates = []
        k = group[0].in_features
        for name in group[0].candidates():
            try:
                kernel = group[0].kernel(name)
            except (ValueError, native.NativeUnavailable) as error:
                logger.info("autotune: %s unavailable for %s: %s", name, key, error)
                continue
            if invariant and not row_invariant(kernel, k, generator):
                logger.info("autotune: %s is not row-invariant for %s: not used", name, key)
                continue
            candidates.append(name)
        if invariant and not candidates:  # none is: the fastest alone, one row at a time
            candidates = [ROWWISE + name for name in group[0].candidates()[:1]]
        sample = _sample(group)
        kernels = {name: [layer.kernel(name) for layer in sample] for name in candidates}
        choices.plans[key], choices.figures[key] = _buckets(kernels, k, generator, invariant)
        for layer in sample:  # only the winners stay built (`tune` builds the others' plans)
            layer.use(choices.plans[key], final=False)
    built: dict[str, list[Kernel]] = {}
    width = int(next(iter(groups.values()))[0].in_features) if groups else 0
    weight_width = _head_width(heads) or width
    plain = {n: make for n, make in heads.items() if not n.startswith(ROWWISE)}
    head_dtype = getattr(getattr(heads["module"](), "weight", None), "dtype", torch.bfloat16)
    for name, make in plain.items():
        try:
            kernel = make()
        except ValueError as error:
            logger.info("autotune: lm_head %s unavailable: %s", name, error)
            continue
        if invariant and not row_invariant(kernel, weight_width, generator, head_dtype):
            logger.info("autotune: lm_head %s is not row-invariant: not used", name)
            continue
        built[name] = [kernel]
    if invariant and not built:  # none is: the module itself, one row at a time
        built[ROWWISE + "module"] = [heads[ROWWISE + "module"]()]
    choices.plans[head_name], choices.figures[head_name] = _buckets(
        built, weight_width, generator, invariant, head_dtype
    )
    logger.info("autotune: %.1f s", time.perf_counter() - started)
    return choices


def _sample(group: list[Int4Linear]) -> list[Int4Linear]:
    """The first layers of a shape, up to SAMPLE_BYTES of weights (at least FEW_LAYERS)."""
    n, k, _ = group[0].shape
    per_layer = max(1, n * k // 2)
    return group[: max(FEW_LAYERS, SAMPLE_BYTES // per_layer)]


def _head_width(heads: dict[str, Callable[[], Kernel]]) -> int:
    module = heads["module"]()
    weight = getattr(module, "weight", None)
    return int(weight.shape[1]) if weight is not None else 0


def _buckets(
    kernels: dict[str, list[Kernel]],
    k: int,
    generator: torch.Generator,
    single: bool = False,
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[list[tuple[int, str]], dict[str, dict[str, float]]]:
    """The fastest of `kernels` (each a list: one per layer) at each bucket's first row count;
    `single`: the one kernel that is fastest over all buckets (the least sum of its times
    relative to each bucket's fastest), for every row count."""
    figures: dict[str, dict[str, float]] = {}
    order = list(kernels)  # one alone is timed too: its figures are the steps' costs
    # (`step_cost`; speculation's policy drafts only where they pay)
    for rows in BUCKETS:
        x = (torch.randn((rows, k), generator=generator) * 0.5).to(dtype)
        timed: dict[str, float] = {}
        for name in order:
            timed[name] = _time(kernels[name], x, CUT * min(timed.values(), default=math.inf))
        order.sort(key=lambda name: timed[name])
        figures[str(rows)] = {name: round(seconds * 1e3, 4) for name, seconds in timed.items()}
    return pick(figures, single), figures


@torch.inference_mode()
def _time(layers: list[Kernel], x: torch.Tensor, cut: float = math.inf) -> float:
    """Seconds one pass over the layers takes, fastest of REPEATS (after one warm pass), or of
    fewer once the fastest is past `cut` (seconds a pass over all the layers)."""
    use = layers if x.shape[0] <= ALL_LAYERS_UP_TO else layers[:FEW_LAYERS]
    scale = len(layers) / len(use)
    for layer in use:
        layer(x)
    best = math.inf
    for _ in range(REPEATS):
        start = time.perf_counter()
        for layer in use:
            layer(x)
        best = min(best, time.perf_counter() - start)
        if best * scale > cut:
            break
    return best * scale


def log_choices(choices: Choices, threads: int) -> None:
    """The CPU, its flags and every choice, for the server log."""
    identity = cpu_identity()
    flags = " ".join(native.relevant_flags(frozenset(identity["flags"])))
    logger.info(
        "kernels for CPU %s, %d threads, torch %s; flags: %s",
        identity["cpu"],
        threads,
        identity["torch"],
        flags,
    )
    for name, plan in choices.plans.items():
        spans = []
        for index, (rows, kernel) in enumerate(plan):
            end = plan[index + 1][0] - 1 if index + 1 < len(plan) else None
            span = f"{rows}+" if end is None else (f"{rows}" if end == rows else f"{rows}-{end}")
            spans.append(f"{span} rows {kernel}")
        logger.info("kernel (%s) %s: %s", choices.source, name, ", ".join(spans))
        for count, timed in choices.figures.get(name, {}).items():
            ranked = sorted(timed.items(), key=lambda item: item[1])
            figures = ", ".join(f"{kernel} {ms:.3f}" for kernel, ms in ranked)
            logger.info("autotune %s at %s rows (ms a pass): %s", name, count, figures)


def _head_name(head: Any) -> str:
    weight = getattr(head, "weight", None)
    return "lm_head " + ("x".join(str(d) for d in weight.shape) if weight is not None else "?")


# -- what a step costs, from the figures (engine/speculation.py asks whether drafts pay) ------
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
