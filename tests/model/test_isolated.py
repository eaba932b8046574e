"""A build phase in a process of its own: its value back, its progress relayed, its refusal and
its failure raised here, and its memory gone with it."""

from __future__ import annotations

import io
import os
from typing import Any

import pytest

from predictor.model import isolated
from predictor.model.progress import Progress


def _grow_and_report(progress: Any, megabytes: int) -> dict[str, int]:
    """In the child: hold `megabytes` of touched memory, report two steps, return pids."""
    import torch

    held = torch.ones(megabytes << 18)  # 4-byte floats, touched
    progress.phase("layer", 2)
    progress.step(1, detail="layer 2: quantizing q_proj")
    progress.step(2)
    progress.say(f"{progress.prefix}held {held.numel() * 4 >> 20} MiB")
    return {"pid": os.getpid(), "threads": torch.get_num_threads()}


def _refuse(progress: Any) -> None:
    raise SystemExit("quality gate failed: ratio 2.000")


def _crash() -> None:
    raise ValueError("a broken phase")


def _die() -> None:
    os._exit(3)


def test_a_phase_runs_in_its_own_process_and_its_progress_is_drawn_here() -> None:
    import psutil

    console = io.StringIO()
    progress = Progress(console, prefix="[test]  ", tty=False)
    before = psutil.Process().memory_info().rss
    found = isolated.run(_grow_and_report, progress, 1, megabytes=256)
    assert found == {"pid": found["pid"], "threads": 1} and found["pid"] != os.getpid()
    lines = console.getvalue().splitlines()
    assert lines[0].startswith("[test]  layer 1/2") and "(layer 2: quantizing q_proj)" in lines[0]
    assert lines[1].startswith("[test]  layer 2/2") and lines[2] == "[test]  held 256 MiB"
    # the child's 256 MiB never were this process's
    assert psutil.Process().memory_info().rss - before < 64 << 20


def test_a_refusal_is_raised_here_with_its_message() -> None:
    with pytest.raises(SystemExit, match=r"quality gate failed: ratio 2\.000"):
        isolated.run(_refuse, Progress(io.StringIO(), tty=False))


def test_a_failure_or_a_killed_phase_is_an_error_that_says_so() -> None:
    with pytest.raises(isolated.ChildFailed, match=r"ValueError: a broken phase"):
        isolated.run(_crash)
    with pytest.raises(isolated.ChildFailed, match=r"exit code 3 before returning"):
        isolated.run(_die)


def _report_a_lock(progress: Any) -> None:
    import threading

    progress.step(1, detail=threading.Lock())


def test_a_progress_call_that_cannot_cross_fails_the_phase_not_silently() -> None:
    with pytest.raises(isolated.ChildFailed, match=r"cannot pickle"):
        isolated.run(_report_a_lock, Progress(io.StringIO(), tty=False))


def _gptqmodel_events(progress: Any) -> list[int]:
    """gptqmodel's subset events as its looper makes them (a processor object included)."""
    import threading

    from predictor.model.recipe import LayerEvents

    released: list[int] = []
    events = LayerEvents(progress, lambda: released.append(1))
    progress.phase("layer", 2)
    for layer in (0, 1):
        for stage in ("forward_start", "quant_start", "quant_complete"):
            events.subset_event(stage=stage, layer_idx=layer, subset_index=0, subset_total=1,
                                module_names=["mlp.down_proj"], processor=threading.Lock())  # fmt: skip
    return released


def test_gptqmodels_layer_events_cross_and_release_each_finished_layer() -> None:
    console = io.StringIO()
    released = isolated.run(_gptqmodel_events, Progress(console, prefix="", tty=False))
    assert released == [1]  # once: when layer 1's first event came
    assert console.getvalue().splitlines()[-1].startswith("layer 2/2")
