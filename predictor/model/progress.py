"""Progress of a long build a person can follow: phase, step (`layer 7/30`), elapsed, time left.

On a terminal one line is redrawn in place with a bar; anywhere else (CI logs, a pipe) plain
lines are printed, one per finished step, plus a heartbeat while a step runs long, so a log
stays short and still shows the build is alive. The estimate of what is left is
the phase's elapsed time scaled by the share of its steps not yet done. `timed_phase` times a
phase of the build while the libraries' own output goes to a log file.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO

BAR_WIDTH = 24
HEARTBEAT = 15.0  # seconds without a step before a plain line says the phase is still running
REDRAW_EVERY = 0.2  # seconds between redraws of a terminal line


def format_duration(seconds: float) -> str:
    """'42 s', '3:07', '1:02:09'."""
    total = max(0, round(seconds))
    if total < 60:
        return f"{total} s"
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def remaining(elapsed: float, done: int, total: int) -> float | None:
    """The phase's time left at its pace so far; None before the first step."""
    if done <= 0 or total <= 0:
        return None
    return elapsed * max(0, total - done) / done


def bar(done: int, total: int, width: int = BAR_WIDTH) -> str:
    filled = 0 if total <= 0 else min(width, width * done // total)
    return "[" + "#" * filled + "." * (width - filled) + "]"


def status_line(
    unit: str, done: int, total: int, elapsed: float, detail: str = "", with_bar: bool = False
) -> str:
    """'layer 7/30 [####....]  23%  1:02 elapsed, about 3:20 left  (mlp.down_proj)'."""
    parts = [f"{unit} {done}/{total}"]
    if with_bar:
        share = 0 if total <= 0 else 100 * done // total
        parts.append(f"{bar(done, total)} {share:3d}%")
    left = remaining(elapsed, done, total)
    timing = f"{format_duration(elapsed)} elapsed"
    if left is not None:
        timing += f", about {format_duration(left)} left"
    parts.append(timing)
    if detail:
        parts.append(f"({detail})")
    return "  ".join(parts)


class Progress:
    """Steps of the current phase, drawn on a terminal or printed as plain lines."""

    def __init__(
        self,
        stream: TextIO,
        prefix: str = "[model]     ",
        tty: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stream = stream
        self.prefix = prefix
        self.tty = stream.isatty() if tty is None else tty
        self.clock = clock
        self.lock = threading.Lock()
        self.phase_started = clock()
        self.unit, self.done, self.total, self.detail = "", 0, 0, ""
        self.last_line = -1e9  # when the last plain line or redraw went out
        self.printed = -1  # the step count of the last plain line
        self.drawn = False  # a terminal line is on screen and not yet ended

    def phase(self, unit: str, total: int) -> None:
        """Start a phase of `total` steps named `unit` (`layer`, `window`)."""
        with self.lock:
            self._end_line()
            self.phase_started = self.clock()
            self.unit, self.done, self.total, self.detail = unit, 0, total, ""
            # the first plain line comes with the first finished step, or a heartbeat later
            self.last_line, self.printed = self.phase_started, 0

    def step(self, done: int, total: int | None = None, detail: str = "") -> None:
        """`done` steps of the phase are finished; `detail` names what runs now.

        A terminal line is redrawn (at most every REDRAW_EVERY seconds, and at the end); a plain
        line is printed once per finished step.
        """
        with self.lock:
            if total is not None:
                self.total = total
            self.done, self.detail = done, detail
            now = self.clock()
            if self.tty:
                if now - self.last_line >= REDRAW_EVERY or done >= self.total:
                    self._emit(now)
            elif done != self.printed:
                self._emit(now)

    def heartbeat(self) -> None:
        """Called every few seconds: keeps a terminal clock moving, shows life in plain logs."""
        with self.lock:
            now = self.clock()
            if self.tty or now - self.last_line >= HEARTBEAT:
                self._emit(now)

    def say(self, message: str) -> None:
        """A line of its own (a phase header, a result)."""
        with self.lock:
            self._end_line()
            self.stream.write(f"{message}\n")
            self.stream.flush()

    def subset_event(
        self,
        *,
        stage: str,
        layer_idx: int,
        subset_index: int,
        subset_total: int,
        module_names: list[str],
        **_: object,
    ) -> None:
        """gptqmodel's subset callback (`model.subset_callback`): a layer is done after its
        last subset is quantized; the detail says which modules of which layer run now."""
        finished = stage == "quant_complete" and subset_index + 1 >= subset_total
        done = min(self.total, layer_idx + 1 if finished else layer_idx)
        doing = "quantizing" if stage.startswith("quant") else "calibration forward"
        names = ", ".join(name.rsplit(".", 1)[-1] for name in module_names[:4])
        detail = "" if finished else f"layer {layer_idx + 1}: {doing} {names}".rstrip()
        self.step(done, detail=detail)

    def close(self) -> None:
        with self.lock:
            self._end_line()

    def _emit(self, now: float) -> None:
        elapsed = now - self.phase_started
        if not self.unit:
            text = f"{format_duration(elapsed)} elapsed"
        else:
            text = status_line(self.unit, self.done, self.total, elapsed, self.detail, self.tty)
        if self.tty:
            self.stream.write(f"\r\x1b[2K{self.prefix}{text}")
            self.drawn = True
        else:
            self.stream.write(f"{self.prefix}{text}\n")
            self.printed = self.done
        self.stream.flush()
        self.last_line = now

    def _end_line(self) -> None:
        if self.drawn:
            self.stream.write("\n")
            self.stream.flush()
            self.drawn = False


def evaluation_steps(progress: Progress) -> Any:
    """evaluate()'s progress messages ("test text: perplexity window 3/7") as steps."""
    counted = re.compile(r"(.*?)(\d+)/(\d+)$")

    def on_message(message: str) -> None:
        match = counted.match(message)
        if match is None:  # "loading checkpoint ...": a line of its own
            progress.phase("", 0)
            progress.say(f"{progress.prefix}{message}")
            return
        what, done, total = match.group(1).strip(), int(match.group(2)), int(match.group(3))
        if progress.unit != what:
            progress.phase(what, total)
        progress.step(done, total)

    return on_message


@contextlib.contextmanager
def timed_phase(
    phases: dict[str, float], name: str, progress: Progress, log_file: Path
) -> Iterator[None]:
    """Time one phase of the build with the libraries' own output sent to a log file."""
    started = time.monotonic()
    progress.phase("", 0)
    try:
        with libraries_to_log(log_file, progress):
            yield
    finally:
        progress.close()
        phases[name] = time.monotonic() - started


@contextlib.contextmanager
def libraries_to_log(log_file: Path, progress: Progress) -> Iterator[None]:
    """Send the libraries' progress bars to a log file; keep ours on the console meanwhile."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved_out, saved_err = os.dup(1), os.dup(2)
    console: TextIO = os.fdopen(os.dup(1), "w")
    done = threading.Event()
    stream = progress.stream
    if stream is sys.stdout or stream is sys.__stdout__:
        progress.stream = console  # fd 1 goes to the log file until the block ends

    def heartbeat() -> None:
        while not done.wait(1.0):
            progress.heartbeat()

    beat = threading.Thread(target=heartbeat, daemon=True)
    with open(log_file, "ab") as sink:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        beat.start()
        try:
            yield
        except BaseException:
            progress.say(f"[model] failed; the libraries' output is in {log_file}")
            raise
        finally:
            done.set()
            beat.join()
            progress.close()
            progress.stream = stream
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved_out, 1)
            os.dup2(saved_err, 2)
            os.close(saved_out)
            os.close(saved_err)
            console.close()
