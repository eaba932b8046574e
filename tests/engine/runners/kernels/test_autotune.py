"""engine/runners/kernels/autotune.py on the tiny GPTQ model: plans per bucket, the disk cache keyed by CPU,
torch and shapes, invalidated when any of them (or the file) is off, forced kernels, the log."""

from __future__ import annotations

import collections
import json
import logging
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from predictor.engine.runners.kernels import autotune
from predictor.engine.runners.kernels.int4_linear import (
    FusedLayer,
    Int4Linear,
    fuse_layer,
    resolve_kernel,
)
from predictor.engine.runners.native import bindings as native


def layers(tiny_gptq: Any) -> tuple[list[Int4Linear], list[str]]:
    found, names = [], []
    for layer in tiny_gptq.model.model.layers:
        fused = fuse_layer(layer)
        assert isinstance(fused, FusedLayer), fused
        for kind in FusedLayer.KINDS:
            found.append(getattr(fused, kind))
            names.append(kind)
    return found, names


def tune(tiny_gptq: Any, cache: Path | None, forced: str = "auto") -> autotune.Choices:
    linears, names = layers(tiny_gptq)
    choices, head, _ = autotune.tune(linears, names, tiny_gptq.model.lm_head, 1, cache, forced)
    x = torch.randn((3, linears[0].in_features)).bfloat16()
    assert head(x).shape == (3, tiny_gptq.model.lm_head.weight.shape[0])
    for layer, kind in zip(linears, names, strict=True):  # every layer runs its plan
        (key,) = [k for k in choices.plans if k.startswith(f"{kind} ")]
        wanted = [(rows, resolve_kernel(name)) for rows, name in choices.plans[key]]
        assert layer.plan == wanted
    return choices


def test_plans_cover_every_bucket_and_are_cached(tiny_gptq: Any, tmp_path: Path) -> None:
    choices = tune(tiny_gptq, tmp_path)
    assert choices.source == "measured"
    kinds = {name.split()[0] for name in choices.plans}
    assert kinds == {"qkv", "o", "gate_up", "down", "lm_head"}
    for name, plan in choices.plans.items():
        assert plan[0][0] == 1 and [r for r, _ in plan] == sorted({r for r, _ in plan})
        assert {r for r, _ in plan} <= set(autotune.BUCKETS)
        if not name.startswith("lm_head"):  # every candidate timed at every bucket
            assert set(choices.figures[name]) == {str(b) for b in autotune.BUCKETS}
    files = list(tmp_path.glob("autotune-*.json"))
    assert len(files) == 1
    again = tune(tiny_gptq, tmp_path)  # read back, not measured
    assert again.source.startswith("cache ") and again.plans == choices.plans


def test_a_candidate_far_behind_stops_being_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A clock that each kernel call moves on by the kernel's cost: a candidate more than CUT
    times the fastest finished one is timed once after its warm pass; the others REPEATS times;
    after the first row count the fastest runs first."""
    now = [0.0]
    calls: collections.Counter[str] = collections.Counter()

    def kernel(name: str, cost: float) -> Callable[[torch.Tensor], torch.Tensor]:
        def run(x: torch.Tensor) -> torch.Tensor:
            calls[name] += 1
            now[0] += cost
            return x

        return run

    monkeypatch.setattr(autotune, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    costs = {"slow": 5.0, "near": 1.5, "fast": 1.0}  # in this order at the first row count
    kernels = {name: [kernel(name, cost)] for name, cost in costs.items()}
    plan, figures = autotune._buckets(kernels, 32, torch.Generator().manual_seed(0))
    assert plan == [(1, "fast")]
    buckets, full = len(autotune.BUCKETS), 1 + autotune.REPEATS
    assert calls["fast"] == calls["near"] == full * buckets
    assert calls["slow"] == full + 2 * (buckets - 1)  # timed in full only while nothing had run
    for timed in figures.values():  # ms a pass: a cut candidate's figure is still its own
        assert timed == {name: cost * 1e3 for name, cost in costs.items()}


def test_the_cache_is_keyed_by_cpu_torch_and_shapes(
    tiny_gptq: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tune(tiny_gptq, tmp_path)
    real = autotune.cpu_identity()
    for change in ({"flags": ["avx2", "fma"]}, {"torch": "0.0.0"}, {"cpu": "Other CPU"}):
        monkeypatch.setattr(autotune, "cpu_identity", lambda c=change: {**real, **c})
        assert tune(tiny_gptq, tmp_path).source == "measured"
    monkeypatch.setattr(autotune, "cpu_identity", lambda: real)
    assert tune(tiny_gptq, tmp_path).source.startswith("cache ")
    assert len(list(tmp_path.glob("autotune-*.json"))) == 4
    base = {"threads": 1, "groups": {"o 64x64/64 x2": ["int4_op"]}}
    assert autotune.cache_key(base) != autotune.cache_key({**base, "threads": 2})
    other = {**base, "groups": {"o 128x64/64 x2": ["int4_op"]}}
    assert autotune.cache_key(base) != autotune.cache_key(other)


def test_a_bad_or_stale_cache_file_is_measured_again(tiny_gptq: Any, tmp_path: Path) -> None:
    tune(tiny_gptq, tmp_path)
    (path,) = tmp_path.glob("autotune-*.json")
    path.write_text("{not json")
    assert tune(tiny_gptq, tmp_path).source == "measured"
    data = json.loads(path.read_text())
    first = next(iter(data["plans"]))
    data["plans"][first] = [[1, "native_f32_neon"]]  # a kernel this machine does not have
    path.write_text(json.dumps(data))
    assert tune(tiny_gptq, tmp_path).source == "measured"
    data = json.loads(path.read_text())
    data["identity"]["source"] = "another kernel source"
    path.write_text(json.dumps(data))
    assert tune(tiny_gptq, tmp_path).source == "measured"


def test_an_unwritable_cache_folder_still_tunes(tiny_gptq: Any, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert tune(tiny_gptq, blocker / "cache").source == "measured"


def test_a_forced_kernel_serves_every_row_count(tiny_gptq: Any) -> None:
    choices = tune(tiny_gptq, None, "int4_op")
    assert choices.source == "forced"
    for name, plan in choices.plans.items():
        if not name.startswith("lm_head"):
            assert plan == [(1, "int4_op")]
    if native.usable_isas():
        choices = tune(tiny_gptq, None, "native_i8")
        assert all(
            plan == [(1, "native_i8")] for n, plan in choices.plans.items() if n[:7] != "lm_head"
        )


def test_the_log_names_the_cpu_its_flags_and_each_choice(
    tiny_gptq: Any, caplog: pytest.LogCaptureFixture
) -> None:
    choices = tune(tiny_gptq, None)
    with caplog.at_level(logging.INFO, logger="predictor.engine.runners.kernels.autotune"):
        autotune.log_choices(choices, 1)
    text = caplog.text
    assert f"kernels for CPU {native.cpu_model()}, 1 threads" in text
    for flag in native.relevant_flags():
        assert flag in text
    for name in choices.plans:
        assert f"{name}: 1" in text


def test_the_int8_head_is_a_candidate_keyed_by_its_source(
    tiny_gptq: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    isas = native.usable_isas()
    if not isas or tiny_gptq.model.lm_head.weight.dtype != torch.bfloat16:
        pytest.skip("int8 lm_head candidates need AVX2/AVX-512 and a bf16 head")
    choices = tune(tiny_gptq, tmp_path)
    (head,) = [name for name in choices.plans if name.startswith("lm_head")]
    timed = set().union(*(set(f) for f in choices.figures[head].values()))
    assert {f"int8_i8_{isas[0]}", f"int8_f32_{isas[0]}"} <= timed  # measured, not assumed
    assert tune(tiny_gptq, tmp_path).source.startswith("cache ")
    changed = tmp_path / "int8_matmul.c"
    changed.write_text(native.INT8_SOURCE.read_text() + "\n/* changed */\n")
    monkeypatch.setattr(native, "INT8_SOURCE", changed)  # another int8 kernel: measured again
    assert tune(tiny_gptq, tmp_path).source == "measured"


def test_lean_plans_leave_out_the_copies_past_the_first_bucket() -> None:
    copy, lean_kernel = "prepacked_bf16", "native_i8_avx2"
    assert autotune.lean([(1, lean_kernel), (16, copy), (64, lean_kernel)]) == [(1, lean_kernel)]
    assert autotune.lean([(1, copy), (8, lean_kernel), (32, copy)]) == [(1, copy), (8, lean_kernel)]
    assert autotune.lean([(1, lean_kernel), (8, "int4_op")]) == [(1, lean_kernel), (8, "int4_op")]


def test_copies_are_built_after_tune_returns(
    tiny_gptq: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """defer_copies (the server's start-up): the layers serve at once on lean plans, every row
    count on the kernels without a bf16 copy; `complete` then builds the copies and switches
    each layer, and the head, to its whole plan."""
    linears, names = layers(tiny_gptq)
    if "prepacked_bf16" not in linears[0].candidates():
        pytest.skip("oneDNN's prepacked bf16 linear is unavailable on this CPU")
    whole = [(1, "int4_op"), (16, "prepacked_bf16")]

    def measured(groups: dict[str, Any], heads: dict[str, Any], head_name: str, *_: Any) -> Any:
        plans = {key: list(whole) for key in groups}
        plans[head_name] = [(1, "module"), (16, "fp32")] if "fp32" in heads else [(1, "module")]
        return autotune.Choices(plans)

    monkeypatch.setattr(autotune, "_measure", measured)
    head_module = tiny_gptq.model.lm_head
    choices, head, deferred = autotune.tune(linears, names, head_module, 1, None, defer_copies=True)
    assert all(layer.plan == [(1, "int4_op")] for layer in linears)
    layer_count = len(linears)
    assert len(deferred) in (layer_count, layer_count + 1)  # the head's too where it has a copy
    x = (torch.randn((16, linears[0].in_features)) * 0.5).bfloat16()
    lean_out = linears[0](x)
    whole_head = autotune.complete(deferred)
    assert all(layer.plan == whole for layer in linears)
    assert (whole_head is not None) == (len(deferred) > layer_count)
    whole_out = linears[0](x)  # the bf16 copy now: the same weights, exactly expanded
    assert torch.allclose(whole_out.float(), lean_out.float(), atol=0.05, rtol=0.05)
    assert choices.plans[next(iter(choices.plans))] == whole
    assert head(x).shape[0] == 16
