"""A pool for CPU-bound jobs that cannot be stopped once they run (grammar compiles), where a
short job must not wait behind long ones.

`threads` slots run jobs in arrival order at a low CPU priority (`niceness`, per thread: Linux).
A job gives its slot up when it has run `quantum` seconds while another job waits for one: its
thread is demoted to the lowest priority (`DEMOTED_NICENESS`) and runs on, and a fresh thread
takes the slot and the next job. So a long job costs a waiting short one at most a quantum, not
the long job's whole run, and never a core that decoding wants: the demoted threads run on what
the slots' threads and the server leave idle (CFS's weight at nice 19 is 15, against 1024 at
nice 0 and 110 at nice 10). A demoted thread ends with its job (an unprivileged thread cannot
raise its priority back). This is a two-level feedback queue with the kernel's scheduler as the
second level, because xgrammar's compile cannot be paused, cancelled or split (0.2.9: no such
API; it runs on the calling thread with the GIL released).

What bounds the demoted threads is the caller's cap on jobs in flight (`--max-grammar-compiles`).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import Any, Generic, TypeVar

from predictor.cpus import container_cpus

T = TypeVar("T")

DEMOTED_NICENESS = 19  # a job past its quantum while others wait: the lowest priority


def default_threads() -> int:
    """Every usable CPU but one, which is left to decoding (at least one)."""
    return max(1, container_cpus() - 1)


def set_niceness(niceness: int, thread_id: int | None = None) -> None:
    """Lower one thread's CPU priority (Linux: nice is per thread; elsewhere: nothing)."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, thread_id or threading.get_native_id(), niceness)


class Job(Generic[T]):
    """One job: `started` gets the monotonic time its run began, `done` its result."""

    __slots__ = ("began", "demoted", "done", "fn", "started", "thread_id")

    def __init__(self, fn: Callable[[], T]) -> None:
        self.fn = fn
        self.started: Future[float] = Future()
        self.done: Future[T] = Future()
        self.began = 0.0
        self.thread_id = 0
        self.demoted = False


class CompilePool:
    """`threads` slots at `niceness`; a job past `quantum` s yields its slot to a waiting one."""

    def __init__(self, threads: int, quantum: float, niceness: int, name: str) -> None:
        self.threads, self.quantum, self.niceness, self.name = threads, quantum, niceness, name
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # a job queued, or closing: for workers
        self._watch = threading.Condition(self._lock)  # the queue or the runs changed: watcher
        self._queue: deque[Job[Any]] = deque()
        self._running: list[Job[Any]] = []
        self._slots = 0  # workers that take jobs (started, not demoted)
        self._idle = 0  # of those, the ones waiting for a job
        self._watcher: threading.Thread | None = None
        self._closed = False
        self.demotions = 0  # jobs that gave their slot up (for tests and logs)

    def submit(self, fn: Callable[[], T]) -> Job[T]:
        job = Job(fn)
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name}: the pool is closed")
            self._queue.append(job)
            self._staff()
            if self._watcher is None:
                self._watcher = self._start(self._watch_loop, "watch")
            self._work.notify()
            self._watch.notify()
        return job

    def cancel(self, job: Job[Any]) -> bool:
        """Drop a job that has not started (True); one that runs goes on (False)."""
        with self._lock:
            if job not in self._queue:
                return False
            self._queue.remove(job)
        job.started.cancel()
        job.done.cancel()
        return True

    def close(self) -> None:
        """Drop the queued jobs; the running ones end on their own (daemon threads)."""
        with self._lock:
            self._closed = True
            dropped, self._queue = list(self._queue), deque()
            self._work.notify_all()
            self._watch.notify_all()
        for job in dropped:
            job.started.cancel()
            job.done.cancel()

    @property
    def waiting(self) -> int:
        """Jobs queued that no idle worker is about to take."""
        return max(0, len(self._queue) - self._idle)

    def _start(self, target: Callable[[], None], role: str) -> threading.Thread:
        thread = threading.Thread(target=target, name=f"{self.name}-{role}", daemon=True)
        thread.start()
        return thread

    def _staff(self) -> None:
        """Start workers for the jobs that wait, up to the slots (called with the lock held)."""
        while self.waiting and self._slots < self.threads:
            self._slots += 1
            self._idle += 1  # counted idle until it takes its first job
            self._start(self._work_loop, "worker")

    def _work_loop(self) -> None:
        set_niceness(self.niceness)
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._work.wait()
                if self._closed:
                    self._slots -= 1
                    self._idle -= 1
                    return
                job = self._queue.popleft()
                self._idle -= 1
                job.thread_id, job.began = threading.get_native_id(), time.monotonic()
                self._running.append(job)
                self._watch.notify()
            self._run(job)
            with self._lock:
                self._running.remove(job)
                if job.demoted:  # its slot has a fresh thread already: this one ends
                    return
                self._idle += 1

    @staticmethod
    def _run(job: Job[Any]) -> None:
        if not job.done.set_running_or_notify_cancel():
            return
        with contextlib.suppress(InvalidStateError):
            job.started.set_result(job.began)
        try:
            result = job.fn()
        except BaseException as exc:  # the caller's to read, as ThreadPoolExecutor does
            job.done.set_exception(exc)
        else:
            job.done.set_result(result)

    def _watch_loop(self) -> None:
        with self._lock:
            while not self._closed:
                self._watch.wait(self._demote_due())

    def _demote_due(self) -> float | None:
        """Demote the jobs past their quantum, oldest first, while others wait for a slot;
        the seconds until the next one is due (None: nothing waits). Lock held."""
        now, due = time.monotonic(), None
        for job in sorted(self._running, key=lambda j: j.began):
            if not self.waiting:
                return None
            if job.demoted:
                continue
            if job.began + self.quantum > now:
                due = job.began + self.quantum - now if due is None else due
                continue
            job.demoted = True
            self.demotions += 1
            set_niceness(DEMOTED_NICENESS, job.thread_id)
            self._slots -= 1
            self._staff()
        return due if self.waiting else None
