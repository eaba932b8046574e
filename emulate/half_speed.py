"""Run a command on half of each core: what a CPU of half this one's speed would take.

    python -m emulate.half_speed -- make test

One busy loop per core, pinned to it, takes the other half of every core for as long as the
command runs. Where the cgroup v1 `cpu` controller is writable (root), the loops and the command
go into two groups of equal weight, so the command gets half of each core however many processes
it runs; elsewhere the loops are plain processes and a command with several runnable processes
per core gets somewhat more than half.

What it approximates, measured on a Zen 5 (2 cores, torch held to AVX2): a 2-thread fp32 matmul
2.3x as long, a 1-thread one 1.45-1.6x (the command's lone thread also gets part of the other core's
group share). It stands in for a slower machine that is not at hand: a figure measured under it
is an estimate, named as one.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

CGROUP_CPU = Path("/sys/fs/cgroup/cpu")
HOG = "# emulate.half_speed: a busy loop\nwhile True:\n    pass"


def cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def make_groups(root: Path = CGROUP_CPU) -> tuple[Path, Path] | None:
    """Two cgroups of equal cpu.shares under `root`, (loops, command); None where not writable."""
    tag = f"half_speed-{os.getpid()}"
    loops, command = root / f"{tag}-loops", root / f"{tag}-command"
    try:
        for group in (loops, command):
            group.mkdir()
            (group / "cpu.shares").write_text("1024")
    except OSError:
        remove_groups((loops, command))
        return None
    return loops, command


def remove_groups(groups: Sequence[Path]) -> None:
    for group in groups:
        with contextlib.suppress(OSError):
            group.rmdir()


def _join(group: Path | None) -> None:
    if group is not None:
        (group / "cgroup.procs").write_text(str(os.getpid()))


@contextlib.contextmanager
def busy_loops(group: Path | None) -> Iterator[list[subprocess.Popen[bytes]]]:
    """One busy loop pinned to each core of this process, ended on leaving."""
    loops: list[subprocess.Popen[bytes]] = []

    def start(core: int) -> subprocess.Popen[bytes]:
        def pin() -> None:
            os.sched_setaffinity(0, {core})
            _join(group)

        return subprocess.Popen([sys.executable, "-c", HOG], preexec_fn=pin)  # noqa: PLW1509

    try:
        for core in cores():
            loops.append(start(core))  # those started are ended, should a later one fail
        yield loops
    finally:
        for loop in loops:
            loop.kill()
        for loop in loops:
            loop.wait()


def run(command: Sequence[str], use_cgroups: bool = True) -> int:
    """`command`'s exit code, run beside one busy loop per core; its wall time on stderr."""
    groups = make_groups() if use_cgroups else None
    loops_group, command_group = groups if groups is not None else (None, None)
    how = "cgroups of equal weight" if groups is not None else "no cgroup"
    try:
        with busy_loops(loops_group) as loops:
            print(f"[half_speed] {len(loops)} busy loops, one per core ({how}): "
                  f"{' '.join(command)}", file=sys.stderr, flush=True)  # fmt: skip
            started = time.monotonic()
            join = functools.partial(_join, command_group)
            code = subprocess.call(list(command), preexec_fn=join)  # noqa: PLW1509
            seconds = time.monotonic() - started
    finally:
        if groups is not None:
            remove_groups(groups)
    print(f"[half_speed] exit {code} after {seconds:.0f} s on half of each core",
          file=sys.stderr, flush=True)  # fmt: skip
    return code


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m emulate.half_speed", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument("--no-cgroups", action="store_true", help="plain busy loops, even as root")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("a command is needed: python -m emulate.half_speed -- make test")
    return run(command, use_cgroups=not args.no_cgroups)


if __name__ == "__main__":
    raise SystemExit(main())
