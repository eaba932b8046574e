"""LoRA adapters by name: which are registered (a name and a path: --lora-modules, vLLM's POST
/v1/load_lora_adapter) and which are resident in a runner slot, made so for the requests
that name them.

At most `limit` adapters are resident (--max-cpu-loras; 0: any number). A request naming one
that is not is admitted once it is made resident (read again from its path), in place of the
least recently used resident adapter that no request uses; one that a request uses is never
evicted. An evicted or unloaded adapter's slot is retired at once (no new request gets it) and
its weights are freed by the step loop once no request uses them. Slots are never reused, so a
request always runs with the weights it was admitted with.

Thread-safe. Reading runs on worker threads; `make_resident` (with `reserve`, the only
eviction) and `slot` run on the event loop, where a request's slot is resolved and the request
made visible to `in_use` in one step, so an adapter chosen for eviction cannot be one a request
is just being admitted with. Freeing runs on the step loop's thread, which knows every row and
waiting request (`free_unused`: what they use is read under this lock, so an adapter unloaded
meanwhile is never freed under a request queued with it)."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from functools import partial
from typing import Any

from predictor.errors import (
    CheckpointError,
    EngineUnavailable,
    InvalidRequest,
    ModelMissing,
    Overloaded,
)

# how long a request waits for a LoRA adapter to be made resident while every resident one is
# in use (--max-cpu-loras) before it is refused as Overloaded
ROOM_WAIT_S = 60.0

InUse = Callable[[], Collection[int]]  # the adapter slots requests use now


class Adapters:
    def __init__(
        self,
        read: Callable[[str, str], Any],
        install: Callable[[int, Any], None],
        remove: Callable[[int], None],
        limit: int = 0,
        max_loras: int = 0,
    ) -> None:
        self.read = read  # (name, path) -> an adapter; raises a PredictorError saying why not
        self.install = install  # (slot, adapter): resident in the runner (blocking)
        self._remove = remove  # (slot): its weights freed (the step loop's thread)
        self.limit = limit  # most adapters resident at once (--max-cpu-loras; 0: any number)
        self.max_loras = max_loras  # most adapters in one step (--max-loras; 0: any number)
        self._lock = threading.Lock()
        self._paths: dict[str, str] = {}  # registered: name -> path
        self._resident: OrderedDict[int, str] = OrderedDict()  # slot -> name, least recent first
        self._reserved: set[int] = set()  # slots being installed (they count as resident)
        self._retired: dict[int, str] = {}  # evicted or unloaded, freed once no request uses them
        self._slots = itertools.count(1)
        self._installing: dict[str, asyncio.Future[None]] = {}  # being made resident

    # -- names --------------------------------------------------------------------------------
    def registered(self, name: str) -> bool:
        return name in self._paths

    def count(self) -> int:
        """How many adapters are registered."""
        return len(self._paths)

    def path(self, name: str) -> str | None:
        return self._paths.get(name)

    def slot(self, name: str) -> int | None:
        """The resident slot of that adapter (now its most recently used), None where it is
        not resident (or not registered)."""
        with self._lock:
            for slot, held in self._resident.items():
                if held == name:
                    self._resident.move_to_end(slot)
                    return slot
        return None

    def names(self) -> dict[int, str]:
        """Each slot's adapter name, for the slots not yet freed (resident or retired)."""
        with self._lock:
            return {**{s: n for s, n in self._retired.items() if n}, **self._resident}

    def resident(self) -> list[str]:
        """The resident adapters' names, least recently used first."""
        with self._lock:
            return list(self._resident.values())

    def requests(
        self, running: Sequence[int], waiting: Sequence[int]
    ) -> tuple[int, list[str], list[str]]:
        """How many adapters may run at once (--max-loras, --max-cpu-loras, else every one
        loaded), and the names of those the running and the waiting requests use (their
        slots given): what vLLM's `lora_requests_info` gauge reports."""
        bounds = [b for b in (self.max_loras, self.limit) if b]
        at_once = min(bounds) if bounds else self.count()
        names = self.names()
        return (
            at_once,
            [names[s] for s in running if s in names],
            [names[s] for s in waiting if s in names],
        )

    # -- registering (blocking: a worker thread, or the start) --------------------------------
    def load(self, name: str, path: str) -> int | None:
        """Read and check an adapter, register it, and make it resident where there is room
        without evicting any: its slot, or None (it is read again when a request needs it)."""
        adapter = self.read(name, path)  # raises before anything is registered
        with self._lock:
            if name in self._paths:
                raise InvalidRequest(f"LoRA adapter '{name}' is already loaded", "lora_name")
            self._paths[name] = path
            slot = self._take() if self._room() else None
        if slot is not None:
            try:
                self.install(slot, adapter)
            except BaseException:  # nothing half-loaded stays
                self.release(slot)
                with self._lock:
                    self._paths.pop(name, None)
                raise
            self.commit(name, slot)
        return slot

    async def load_now(self, name: str, path: str) -> None:
        """`load` off the event loop, at run time: the adapter's files are the client's to fix
        (InvalidRequest with the reason)."""
        try:
            await asyncio.to_thread(self.load, name, path)
        except CheckpointError as exc:
            raise InvalidRequest(str(exc), "lora_path") from exc

    def unload(self, name: str) -> None:
        """Unregistered at once: new requests naming it are refused; its weights go once no
        request uses them."""
        with self._lock:
            if self._paths.pop(name, None) is None:
                raise ModelMissing(f"LoRA adapter '{name}' is not loaded")
            for slot, held in list(self._resident.items()):
                if held == name:
                    del self._resident[slot]
                    self._retired[slot] = name

    # -- resident for requests (the event loop) -----------------------------------------------
    async def make_resident(self, names: set[str], in_use: InUse) -> None:
        """Every one of `names` resident: each that is not is read again and installed in
        place of the least recently used adapter no request uses (`in_use`), waiting while
        every resident one is in use (Overloaded after ROOM_WAIT_S)."""
        if not names:
            return
        if self.limit and len(names) > self.limit:
            raise InvalidRequest(
                f"{len(names)} LoRA adapters in one request; "
                f"{self.limit} can be resident (--max-cpu-loras)"
            )
        while missing := [n for n in names if self.slot(n) is None]:
            for name in missing:
                task = self._installing.get(name)
                if task is None:
                    task = asyncio.ensure_future(self._install(name, in_use))
                    self._installing[name] = task
                    task.add_done_callback(partial(self._installed, name))
                await asyncio.shield(task)

    def _installed(self, name: str, _: asyncio.Future[None]) -> None:
        self._installing.pop(name, None)

    async def _install(self, name: str, in_use: InUse) -> None:
        if self.path(name) is None:  # unloaded meanwhile: evict nothing for it
            raise ModelMissing(f"LoRA adapter '{name}' is not loaded")
        waited = time.monotonic() + ROOM_WAIT_S
        while (slot := self.reserve(in_use())) is None:
            if time.monotonic() > waited:
                raise Overloaded(
                    f"LoRA adapter '{name}' waits for room: the {self.limit} "
                    "resident adapters are all in use (--max-cpu-loras)"
                )
            await asyncio.sleep(0.02)
        try:
            path = self.path(name)
            if path is None:
                raise ModelMissing(f"LoRA adapter '{name}' is not loaded")
            try:
                adapter = await asyncio.to_thread(self.read, name, path)
            except CheckpointError as exc:  # its files changed since it was loaded
                raise EngineUnavailable(
                    f"LoRA adapter '{name}' cannot be read again: {exc}"
                ) from exc
            await asyncio.to_thread(self.install, slot, adapter)
        except BaseException:
            self.release(slot)
            raise
        self.commit(name, slot)

    # -- making room (reserve on the event loop; install on a worker thread) ------------------
    def reserve(self, in_use: Collection[int]) -> int | None:
        """A new slot to install an adapter in, evicting the least recently used resident
        adapter that no request uses where the limit is reached; None: every resident adapter
        is in use."""
        with self._lock:
            if not self._room():
                victim = next((s for s in self._resident if s not in in_use), None)
                if victim is None:
                    return None
                self._retired[victim] = self._resident.pop(victim)
            return self._take()

    def commit(self, name: str, slot: int) -> None:
        """The adapter installed in its reserved slot is resident (retired at once where it
        was unloaded meanwhile, or made resident twice)."""
        with self._lock:
            self._reserved.discard(slot)
            if name in self._paths and name not in self._resident.values():
                self._resident[slot] = name
            else:
                self._retired[slot] = name

    def release(self, slot: int) -> None:
        """A reserved slot whose install failed: whatever it holds is freed."""
        with self._lock:
            self._reserved.discard(slot)
            self._retired[slot] = ""

    # -- freeing (the step loop's thread, between steps) --------------------------------------
    def retiring(self) -> bool:
        """Whether retired adapters' weights wait to be freed (a step's cheap check)."""
        return bool(self._retired)

    def free_unused(self, in_use: InUse) -> None:
        """Free the retired adapters no request uses (`in_use`, read under the lock)."""
        if not self._retired:
            return
        with self._lock:
            used = in_use()
            done = [slot for slot in self._retired if slot not in used]
            for slot in done:
                del self._retired[slot]
        for slot in done:
            self._remove(slot)

    def _room(self) -> bool:
        return not self.limit or len(self._resident) + len(self._reserved) < self.limit

    def _take(self) -> int:
        slot = next(self._slots)
        self._reserved.add(slot)
        return slot
