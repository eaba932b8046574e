"""observability/startup.py: the phases of a start, logged once ready."""

from __future__ import annotations

import logging

import pytest

from predictor.observability.startup import StartupClock, process_age


def test_ready_logs_each_phase_and_the_total(caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    clock = StartupClock(clock=lambda: now[0], age=2.0)  # the process began 2 s ago
    for phase, seconds in (("load", 3.0), ("engine", 1.5)):
        now[0] += seconds
        clock.mark(phase)
    now[0] += 4.0
    with caplog.at_level(logging.INFO, logger="predictor"):
        clock.ready()
    assert [name for name, _ in clock.phases] == ["load", "engine", "kernels"]
    assert "ready after 10.5 s: load 5.0 s, engine 1.5 s, kernels 4.0 s" in caplog.text


def test_process_age_counts_this_process_since_it_began() -> None:
    age = process_age()
    assert 0.0 < age < 24 * 3600  # pytest has run for a while, not for days
