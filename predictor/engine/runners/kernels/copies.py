"""Copies of the weights: the kernels that keep a matmul's weights a second time beside the
4-bit ones (a bf16 expansion of a projection; lm_head's fp32, prepacked bf16 or int8 copy), what
each costs in bytes, and the plan each matmul gets from the autotune's figures: a copy only
where it measures COPY_MARGIN faster than the best kernel without one, and all of them within
--max-weight-copies-gb (past it, the copies that buy the least time per byte are dropped
first)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping

from predictor.engine.runners.kernels.autotune_cache import Choices
from predictor.engine.runners.kernels.invariance import ROWWISE

INT8 = "int8_"  # lm_head's int8 tables (head_linear.py)
COPIES = ("prepacked_bf16", "fp32", INT8)  # names, or prefixes of names
# A copy wins a bucket (or, one kernel for every row count, the sum over buckets of each
# kernel's time relative to the bucket's fastest) only this much faster than the best kernel
# without one (or with one a smaller bucket already holds): a policy on memory, not a speed
# measured anywhere.
COPY_MARGIN = 1.15
# bytes a copy keeps per weight: bf16, fp32, and int8_matmul.c's layout (per 32 weights of a
# row, 32 int8 codes, a bf16 scale and an int16 sum: int8_bytes)
BYTES_PER_WEIGHT = {"prepacked_bf16": 2.0, "fp32": 4.0, INT8: 36 / 32}

Plan = list[tuple[int, str]]
Figures = Mapping[str, Mapping[str, float]]  # row count -> kernel -> ms a pass


def is_copy(name: str) -> bool:
    return name.removeprefix(ROWWISE).startswith(COPIES)


def copy_bytes(name: str, n: int, k: int) -> int:
    """Bytes kernel `name` keeps for one [n, k] matmul beyond the 4-bit weights (0: none)."""
    bare = name.removeprefix(ROWWISE)
    per = next((b for prefix, b in BYTES_PER_WEIGHT.items() if bare.startswith(prefix)), 0.0)
    return int(per * n * k)


def plan_bytes(plan: Plan, n: int, k: int, count: int, replaces: bool = False) -> int:
    """Bytes of copies `plan` keeps over `count` matmuls of [n, k] (each copy kept once);
    `replaces`: an int8 table serving every row count takes the place of the weights (lm_head's,
    matmuls.py): no copy then."""
    names = {name for _, name in plan}
    if replaces and all(name.removeprefix(ROWWISE).startswith(INT8) for name in names):
        return 0
    return count * sum(copy_bytes(name, n, k) for name in names)


def held_bytes(
    choices: Choices, sizes: Mapping[str, tuple[int, int, int]], replaced: Collection[str] = ()
) -> int:
    """Bytes the copies of `choices`' plans keep (`sizes`, `replaced`: as `within_budget`'s)."""
    return sum(
        plan_bytes(plan, *sizes[key], key in replaced)
        for key, plan in choices.plans.items()
        if key in sizes
    )


def pick(
    figures: Figures, single: bool, allowed: Callable[[str], bool] = lambda name: True
) -> Plan:
    """The plan the figures give among the `allowed` kernels: per bucket (row counts ascending)
    the fastest, or with `single` the one kernel fastest over all buckets (the least sum of its
    times relative to each bucket's fastest); a copy only where it beats the best kernel
    without one (or, per bucket, with a copy an earlier bucket already holds) by COPY_MARGIN."""
    buckets = sorted(
        (int(rows), {name: t for name, t in timed.items() if allowed(name)})
        for rows, timed in figures.items()
    )
    if single:
        names = {name for _, timed in buckets for name in timed}
        if not names:
            return []

        def relative(name: str) -> float:
            return sum(t[name] / min(t.values()) for _, t in buckets if name in t)

        return [(buckets[0][0], _lean_best(names, relative, set()))]
    plan: Plan = []
    for rows, timed in buckets:
        if not timed:
            continue
        best = _lean_best(set(timed), timed.__getitem__, {name for _, name in plan})
        if not plan or plan[-1][1] != best:
            plan.append((rows, best))
    return plan


def _lean_best(names: set[str], cost: Callable[[str], float], held: set[str]) -> str:
    best = min(sorted(names), key=cost)
    lean = [name for name in sorted(names) if not is_copy(name) or name in held]
    if best not in lean and lean:
        runner_up = min(lean, key=cost)
        if cost(runner_up) < cost(best) * COPY_MARGIN:
            return runner_up
    return best


def within_budget(
    choices: Choices,
    sizes: Mapping[str, tuple[int, int, int]],
    budget: int,
    single: bool,
    replaced: Collection[str] = (),
) -> list[str]:
    """Change `choices.plans` so their copies keep at most `budget` bytes: the measured plans
    holding copies are replaced by their plans without (from the same figures) in the order of
    the time each copy saves per byte, least first, until the rest fit. `sizes`: per matmul,
    its [n, k] and how many layers share its plan; `replaced`: the matmuls whose int8 table,
    where it serves every row count, takes the place of their own weights (no copy then).
    Returns what was dropped, for the log; plans with no figures (a forced --kernel), or with
    none of a kernel without a copy (lm_head's, where only its copies are row-invariant), are
    left as they are."""
    held = {
        key: plan_bytes(plan, *sizes[key], key in replaced)
        for key, plan in choices.plans.items()
        if key in sizes
    }
    total = sum(held.values())
    dropping: list[tuple[float, str, Plan]] = []
    for key, bytes_held in held.items():
        figures = choices.figures.get(key)
        if not bytes_held or not figures:
            continue
        without = pick(figures, single, lambda name: not is_copy(name))
        if not without:
            continue
        saved = _relative_cost(figures, without) - _relative_cost(figures, choices.plans[key])
        dropping.append((saved / bytes_held, key, without))
    dropped = []
    for _, key, without in sorted(dropping):
        if total <= budget:
            break
        total -= held[key]
        dropped.append(
            f"{key}'s {_names(choices.plans[key])} ({held[key] / 1e6:.0f} MB; budget "
            f"{budget / 1e6:.0f} MB)"
        )
        choices.plans[key] = without
    return dropped


def _relative_cost(figures: Figures, plan: Plan) -> float:
    """A plan's time summed over the buckets, each relative to that bucket's fastest."""
    total = 0.0
    for rows, timed in figures.items():
        kernel = next((name for start, name in reversed(plan) if start <= int(rows)), plan[0][1])
        if kernel in timed and timed:
            total += timed[kernel] / min(timed.values())
    return total


def _names(plan: Plan) -> str:
    return ", ".join(sorted({name for _, name in plan if is_copy(name)}))
