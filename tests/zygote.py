"""A fork server for the tests' `python -m predictor` servers (`python -m tests.zygote`).

A server start spends most of its ~9 s importing (torch, transformers, kserve, fastapi, grpc:
5.5 s of CPU on the Zen 5), and the tests start about fifteen. This process imports them once
per test worker, then forks a child per start; the child runs `python -m predictor` with the
request's arguments, folder, environment and log file, as a fresh interpreter would.

Protocol, one JSON object a line: on stdin `{"id", "args", "cwd", "env", "log"}` asks for a
start, answered on stdout by `{"id", "pid"}` (or `{"id", "error"}`); `{"pid", "code"}` reports a
child's exit (the code as subprocess gives it: negative for a signal). EOF on stdin ends it.

Nothing is started before a fork: importing torch starts no OpenMP pool and importing grpc no
core threads (both would not survive a fork), and this process runs no threads of its own.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import runpy
import select
import signal
import sys
import threading
import traceback
from typing import Any, BinaryIO

# what `python -m predictor` imports before it serves, for a tiny checkpoint
PRELOAD = (
    "torch",
    "transformers",
    "predictor.__main__",
    "predictor.model.loader",
    "predictor.serving.app",
    # What a start imports lazily: transformers' modules for a Llama, and what optimum.gptq
    # imports besides gptqmodel (3.6 -> 1.8 s a start of the tiny model's server, Zen 5). Not
    # gptqmodel itself (nor optimum.gptq, which imports it): its import starts threads.
    "transformers.modeling_utils",
    "transformers.models.llama.modeling_llama",
    "datasets",
)


def main() -> int:
    sys.argv = sys.argv[:1]  # kserve parses sys.argv when it is first imported
    reports = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)  # whatever the imports print goes to stderr, not into the reports
    for name in PRELOAD:
        __import__(name)
    import transformers

    transformers.AutoModelForCausalLM, transformers.AutoTokenizer  # noqa: B018 (lazy imports)
    if threading.active_count() > 1:  # a child would lack them (and any lock they held)
        names = [thread.name for thread in threading.enumerate()]
        print(f"tests.zygote: the preloads started threads {names}; not forking", file=sys.stderr)
        return 1
    # the preloads live as long as every child: no child's collections walk them (nor write
    # to their pages, which the child then shares with this process), as Python's gc docs advise
    gc.freeze()
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    requests = sys.stdin.buffer
    pending = b""
    while True:
        ready, _, _ = select.select([requests.fileno(), wake_read], [], [])
        if wake_read in ready:
            os.read(wake_read, 4096)
            _reap(reports)
        if requests.fileno() in ready:
            chunk = os.read(requests.fileno(), 65536)
            if not chunk:
                return 0
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                _start(json.loads(line), reports, (requests.fileno(), wake_read, wake_write))


def _send(reports: BinaryIO, message: dict[str, Any]) -> None:
    reports.write(json.dumps(message).encode() + b"\n")


def _reap(reports: BinaryIO) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(reports, {"pid": pid, "code": os.waitstatus_to_exitcode(status)})


def _start(request: dict[str, Any], reports: BinaryIO, own_fds: tuple[int, ...]) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        pid = os.fork()
    except OSError as error:
        _send(reports, {"id": request["id"], "error": str(error)})
        return
    if pid:
        os.close(log)
        _send(reports, {"id": request["id"], "pid": pid})
        return
    try:  # the child: from here on, `python -m predictor` with the request's world
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in (*own_fds, reports.fileno()):
            os.close(fd)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = [sys.executable, *request["args"]]
        code = _run_predictor()
        atexit._run_exitfuncs()  # as a fresh interpreter does at its exit
    except BaseException:  # noqa: BLE001 (the child must never return into the server loop)
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _run_predictor() -> int:
    try:
        runpy.run_module("predictor", run_name="__main__", alter_sys=True)
    except SystemExit as done:
        if done.code is None or isinstance(done.code, int):
            return int(done.code or 0)
        print(done.code, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
