"""Build progress (predictor.model.progress): formatting, estimates, terminal and plain output."""

from __future__ import annotations

import io
from typing import Any

from predictor.model.progress import (
    HEARTBEAT,
    Progress,
    bar,
    evaluation_steps,
    format_duration,
    remaining,
    status_line,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_durations_read_as_seconds_minutes_and_hours() -> None:
    assert format_duration(0) == "0 s"
    assert format_duration(42.4) == "42 s"
    assert format_duration(187) == "3:07"
    assert format_duration(3729) == "1:02:09"
    assert format_duration(-5) == "0 s"


def test_time_left_follows_the_pace_so_far() -> None:
    assert remaining(60.0, 0, 30) is None  # nothing done: no estimate yet
    assert remaining(60.0, 10, 30) == 120.0
    assert remaining(60.0, 30, 30) == 0.0


def test_bar_fills_with_the_share_done() -> None:
    assert bar(0, 30, width=10) == "[..........]"
    assert bar(15, 30, width=10) == "[#####.....]"
    assert bar(30, 30, width=10) == "[##########]"
    assert bar(1, 0, width=4) == "[....]"


def test_status_line_names_the_step_elapsed_and_left() -> None:
    line = status_line("layer", 7, 30, 70.0, "layer 8: quantizing q_proj")
    assert line == "layer 7/30  1:10 elapsed, about 3:50 left  (layer 8: quantizing q_proj)"
    with_bar = status_line("layer", 15, 30, 10.0, with_bar=True)
    assert "[############............]  50%" in with_bar


def test_plain_output_prints_one_line_per_finished_step() -> None:
    out, clock = io.StringIO(), Clock()
    progress = Progress(out, prefix="> ", tty=False, clock=clock)
    progress.phase("layer", 3)
    progress.step(0, detail="layer 1: calibration forward")  # nothing finished yet
    clock.now += 10
    progress.step(1, detail="layer 2: quantizing q_proj")
    progress.step(1, detail="layer 2: quantizing o_proj")  # same count: no new line
    clock.now += 10
    progress.step(3)
    lines = out.getvalue().splitlines()
    assert lines == [
        "> layer 1/3  10 s elapsed, about 20 s left  (layer 2: quantizing q_proj)",
        "> layer 3/3  20 s elapsed, about 0 s left",
    ]
    assert "\r" not in out.getvalue()


def test_plain_heartbeat_only_after_a_quiet_spell() -> None:
    out, clock = io.StringIO(), Clock()
    progress = Progress(out, prefix="", tty=False, clock=clock)
    progress.phase("", 0)
    progress.heartbeat()
    assert out.getvalue() == ""
    clock.now += HEARTBEAT
    progress.heartbeat()
    assert out.getvalue() == f"{HEARTBEAT:.0f} s elapsed\n"


def test_terminal_output_redraws_one_line_with_a_bar() -> None:
    out, clock = io.StringIO(), Clock()
    progress = Progress(out, prefix="", tty=True, clock=clock)
    progress.phase("layer", 30)
    clock.now += 14
    progress.step(7, detail="layer 8: quantizing q_proj")
    clock.now += 1
    progress.heartbeat()  # the clock moves on a terminal
    progress.say("[model] 3/4 quality")  # a line of its own ends the drawn one first
    text = out.getvalue()
    assert text.count("\r\x1b[2K") == 2
    assert "layer 7/30  [#####...................]  23%  14 s elapsed, about 46 s left" in text
    assert text.endswith("\n[model] 3/4 quality\n")


def test_gptqmodel_subset_events_count_finished_layers() -> None:
    out, clock = io.StringIO(), Clock()
    progress = Progress(out, prefix="", tty=False, clock=clock)
    progress.phase("layer", 30)
    names = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
    event: dict[str, Any] = {"layer_idx": 6, "subset_total": 4, "processor": "gptq"}
    progress.subset_event(stage="forward_start", subset_index=0, module_names=names, **event)
    assert (
        progress.done == 6
        and progress.detail == "layer 7: calibration forward q_proj, k_proj, v_proj"
    )
    progress.subset_event(stage="quant_complete", subset_index=2, module_names=names, **event)
    assert progress.done == 6
    clock.now += 7
    progress.subset_event(
        stage="quant_complete", subset_index=3, module_names=["mlp.down_proj"], **event
    )
    assert progress.done == 7
    assert out.getvalue().splitlines()[-1] == "layer 7/30  7 s elapsed, about 23 s left"


def test_evaluation_messages_become_steps_and_lines() -> None:
    out = io.StringIO()
    progress = Progress(out, prefix="> ", tty=False)
    on_message = evaluation_steps(progress)
    on_message("loading checkpoint x")
    on_message("test text: perplexity window 1/2")
    on_message("test text: perplexity window 2/2")
    lines = out.getvalue().splitlines()
    assert lines[0] == "> loading checkpoint x"
    assert lines[1].startswith("> test text: perplexity window 1/2  ")
    assert lines[2].startswith("> test text: perplexity window 2/2  ")
