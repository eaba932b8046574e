"""engine/runners/kernels/autotune_cache.py without a model: choices written are read back for the same
identity only, and a file that names a kernel not allowed, or not every matmul, is not used."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from predictor.engine.runners.kernels.autotune_cache import (
    Choices,
    cache_file,
    cache_key,
    read_cache,
    write_cache,
)


def identity(**changes: Any) -> dict[str, Any]:
    return {
        "cpu": "Some CPU",
        "flags": ["avx2", "fma"],
        "torch": "2.13.0",
        "forced": "auto",
        "groups": {"o 64x64/64 x2": ["int4_op", "native_i8_avx2"]},
        "head": ["lm_head 100x64", 1, ["loaded", "fp32"]],
        **changes,
    }


def choices() -> Choices:
    plans = {
        "o 64x64/64 x2": [(1, "native_i8_avx2"), (16, "int4_op")],
        "lm_head 100x64": [(1, "fp32")],
    }
    return Choices(plans, {"o 64x64/64 x2": {"1": {"native_i8_avx2": 0.1}}})


def test_written_choices_are_read_back_for_the_same_identity_only(tmp_path: Path) -> None:
    mine = identity()
    write_cache(tmp_path, cache_key(mine), mine, choices())
    read = read_cache(tmp_path, cache_key(mine), mine)
    assert read is not None and read.plans == choices().plans
    assert read.source == f"cache {cache_file(tmp_path, cache_key(mine))}"
    assert [p.name for p in tmp_path.iterdir()] == [cache_file(tmp_path, cache_key(mine)).name]
    other = identity(torch="0.0.0")
    assert cache_key(other) != cache_key(mine)
    assert read_cache(tmp_path, cache_key(other), other) is None  # no file for it
    path = cache_file(tmp_path, cache_key(mine))
    path.rename(cache_file(tmp_path, cache_key(other)))  # a file whose identity is not ours
    assert read_cache(tmp_path, cache_key(other), other) is None
    assert read_cache(None, cache_key(mine), mine) is None


def test_a_file_naming_a_kernel_not_allowed_or_missing_a_matmul_is_not_used(
    tmp_path: Path,
) -> None:
    mine = identity()
    key = cache_key(mine)
    write_cache(tmp_path, key, mine, choices())
    path = cache_file(tmp_path, key)
    data = json.loads(path.read_text())
    data["plans"]["o 64x64/64 x2"] = [[1, "native_f32_neon"]]
    path.write_text(json.dumps(data))
    assert read_cache(tmp_path, key, mine) is None
    forced = identity(forced="int4_op")  # a forced kernel: the cached plan must use it alone
    write_cache(tmp_path, cache_key(forced), forced, choices())
    assert read_cache(tmp_path, cache_key(forced), forced) is None
    del data["plans"]["lm_head 100x64"]
    data["plans"]["o 64x64/64 x2"] = [[1, "int4_op"]]
    path.write_text(json.dumps(data))
    assert read_cache(tmp_path, key, mine) is None


def test_the_first_servers_choices_are_kept_and_a_broken_file_replaced(tmp_path: Path) -> None:
    """Two servers that measured at once: the second to write gets the first's choices back,
    so both serve the same kernels; a file that does not read back is replaced by ours."""
    mine = identity()
    key = cache_key(mine)
    assert write_cache(tmp_path, key, mine, choices()).plans == choices().plans
    theirs = Choices({**choices().plans, "lm_head 100x64": [(1, "loaded")]})
    kept = write_cache(tmp_path, key, mine, theirs)
    assert kept.plans == choices().plans and kept.source.startswith("cache ")
    cache_file(tmp_path, key).write_text("{not json")
    assert write_cache(tmp_path, key, mine, theirs).plans == theirs.plans
    read = read_cache(tmp_path, key, mine)
    assert read is not None and read.plans == theirs.plans
    assert sorted(p.name for p in tmp_path.iterdir()) == [cache_file(tmp_path, key).name]
    assert write_cache(None, key, mine, theirs) is theirs
