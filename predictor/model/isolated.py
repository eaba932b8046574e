"""A phase of a build run in a process of its own, so the build's peak memory is its largest
phase's, not the sum of what each phase left behind.

A process that loaded a model and let it go keeps most of those pages: glibc's heap, torch's
caches, gptqmodel's module state. Run in one process, the quantize command's in-process gate
started on top of what the GPTQ phase left, and the served gate's server on top of both
(load/RESULTS.md, "Quantizing a source": 3.2, 3.8 and 4.5 GiB at the 135M shape). `run`
starts a fresh interpreter (multiprocessing's spawn: no fork of a process whose OpenMP threads
are running), calls one module-level function in it and returns what it returned; when the
child ends, all it held goes back. Its progress calls (Progress's `phase`, `step`, `say`,
`subset_event`, or any other public method) come back over a queue to the caller's object,
which makes them as if they were its own (a Progress draws them with its own clock). A
SystemExit in the child (a gate's refusal) is raised again here with its message, any other
error as a ChildFailed with the child's traceback.
"""

from __future__ import annotations

import multiprocessing
import pickle
import queue
import traceback
from collections.abc import Callable
from typing import Any

POLL_SECONDS = 0.2


class ChildFailed(RuntimeError):
    """A phase's process raised or died; the message holds its traceback or exit code."""


class RelayedProgress:
    """The child's progress object: every public method call is put on the queue for the
    parent's object to make; `prefix` is the parent's."""

    def __init__(self, calls: Any, prefix: str) -> None:
        self._calls = calls
        self.prefix = prefix

    def __getattr__(self, name: str) -> Callable[..., None]:
        if name.startswith("_"):
            raise AttributeError(name)

        def relay(*args: Any, **kwargs: Any) -> None:
            message = ("progress", name, args, kwargs)
            pickle.dumps(message)  # here, not in the queue's feeder thread, which only logs
            self._calls.put(message)

        return relay


def run(
    function: Callable[..., Any],
    progress: Any = None,
    torch_threads: int | None = None,
    **kwargs: Any,
) -> Any:
    """`function(**kwargs)` in a fresh process (with `progress=` a relay to `progress` when one
    is given, and torch held to `torch_threads`); its return value, which must pickle, as must the
    function (module level) and `kwargs`."""
    context = multiprocessing.get_context("spawn")
    calls = context.Queue()
    child = context.Process(
        target=_child,
        args=(
            calls,
            function,
            kwargs,
            torch_threads,
            None if progress is None else str(getattr(progress, "prefix", "")),
        ),
        daemon=False,
    )
    child.start()
    try:
        while True:
            try:
                message = calls.get(timeout=POLL_SECONDS)
            except queue.Empty:
                if not child.is_alive():
                    child.join()
                    raise ChildFailed(
                        f"{function.__name__}'s process ended with exit code {child.exitcode} "
                        "before returning (killed for memory?)"
                    ) from None
                continue
            kind = message[0]
            if kind == "progress":
                if progress is not None:
                    _, name, args, call_kwargs = message
                    getattr(progress, name)(*args, **call_kwargs)
            elif kind == "result":
                child.join()
                return message[1]
            elif kind == "exit":
                child.join()
                raise SystemExit(message[1])
            else:
                child.join()
                raise ChildFailed(f"{function.__name__} failed in its process:\n{message[1]}")
    finally:
        if child.is_alive():
            child.terminate()
            child.join(10)
        calls.close()


def _child(
    calls: Any,
    function: Callable[..., Any],
    kwargs: dict[str, Any],
    threads: int | None,
    prefix: str | None,
) -> None:
    try:
        if threads is not None:
            import torch

            torch.set_num_threads(threads)
        if prefix is not None:
            kwargs = {**kwargs, "progress": RelayedProgress(calls, prefix)}
        calls.put(("result", function(**kwargs)))
    except SystemExit as exit:
        calls.put(("exit", str(exit.code)))
    except BaseException:
        calls.put(("error", traceback.format_exc()))
