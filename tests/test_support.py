"""The test helpers' own rules: how pytest-xdist workers take turns with a `serial` test."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from tests.support import taking_turns


def _hold(folder: Path, alone: bool, seconds: float, log: list[tuple[str, float, float]]) -> None:
    with taking_turns(folder, alone):
        start = time.monotonic()
        time.sleep(seconds)
        log.append(("alone" if alone else "shared", start, time.monotonic()))


def test_tests_share_turns_and_a_serial_one_runs_alone(tmp_path: Path) -> None:
    """Each thread opens the lock files itself, as a worker process does (flock locks belong to
    an open file): two shared holders overlap, the one alone overlaps nobody."""
    log: list[tuple[str, float, float]] = []
    threads = [threading.Thread(target=_hold, args=(tmp_path, False, 0.3, log)) for _ in range(2)]
    for thread in threads:
        thread.start()
    time.sleep(0.1)  # both shared turns are held: the one alone must wait for them
    alone = threading.Thread(target=_hold, args=(tmp_path, True, 0.3, log))
    alone.start()
    time.sleep(0.1)  # it waits at the lock, holding the turnstile: a later shared turn waits too
    late = threading.Thread(target=_hold, args=(tmp_path, False, 0.1, log))
    late.start()
    for thread in [*threads, alone, late]:
        thread.join(timeout=10)
    assert [kind for kind, _, _ in log] == ["shared", "shared", "alone", "shared"]
    (_, s1, e1), (_, s2, e2), (_, a_start, a_end), (_, l_start, _) = log
    assert max(s1, s2) < min(e1, e2)  # the two shared turns overlapped
    assert a_start >= max(e1, e2) - 0.01  # the one alone began after both had ended
    assert l_start >= a_end - 0.01  # and the late shared turn after it
