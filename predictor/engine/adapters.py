"""LoRA adapters by name: the runner slot each is resident in. Loaded at start (--lora-modules)
and at run time (vLLM's POST /v1/load_lora_adapter); an unloaded adapter's name is gone at once
and its weights are freed by the step loop once no request uses them. Slots are never reused,
so a request always runs with the adapter it was admitted with."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from predictor.errors import InvalidRequest, ModelMissing


@dataclass(frozen=True)
class Loaded:
    name: str
    path: str
    slot: int


class Adapters:
    """Thread-safe: loading reads files on any thread, requests resolve names on the event loop,
    the step loop frees what is unused."""

    def __init__(
        self,
        read: Callable[[str, str], Any],
        install: Callable[[int, Any], None],
        remove: Callable[[int], None],
        limit: int = 0,
    ) -> None:
        self._read = read  # (name, path) -> an adapter; raises a PredictorError saying why not
        self._install = install  # (slot, adapter): resident in the runner
        self._remove = remove  # (slot): its weights freed (the step loop's thread)
        self.limit = limit  # most adapters loaded at once (--max-cpu-loras; 0: any number)
        self._lock = threading.Lock()
        self._by_name: dict[str, Loaded] = {}
        self._loading: set[str] = set()
        self._retired: set[int] = set()  # unloaded, freed once no request uses them
        self._slots = itertools.count(1)

    def slot(self, name: str) -> int | None:
        loaded = self._by_name.get(name)
        return None if loaded is None else loaded.slot

    def loaded(self) -> list[Loaded]:
        return list(self._by_name.values())

    def names(self) -> dict[int, str]:
        """The loaded adapters' names by slot."""
        return {loaded.slot: loaded.name for loaded in list(self._by_name.values())}

    def load(self, name: str, path: str) -> Loaded:
        """Read, check and install an adapter (blocking: a worker thread at run time)."""
        with self._lock:
            if name in self._by_name or name in self._loading:
                raise InvalidRequest(f"LoRA adapter '{name}' is already loaded", "lora_name")
            if self.limit and len(self._by_name) + len(self._loading) >= self.limit:
                raise InvalidRequest(f"{self.limit} LoRA adapters are loaded (--max-cpu-loras); "
                                     "unload one first", "lora_name")  # fmt: skip
            self._loading.add(name)
        try:
            adapter = self._read(name, path)
            with self._lock:
                slot = next(self._slots)
            self._install(slot, adapter)
            loaded = Loaded(name, path, slot)
            with self._lock:
                self._by_name[name] = loaded
            return loaded
        finally:
            with self._lock:
                self._loading.discard(name)

    def unload(self, name: str) -> None:
        with self._lock:
            loaded = self._by_name.pop(name, None)
            if loaded is None:
                raise ModelMissing(f"LoRA adapter '{name}' is not loaded")
            self._retired.add(loaded.slot)

    def retiring(self) -> bool:
        """Whether unloaded adapters' weights wait to be freed (a step's cheap check)."""
        return bool(self._retired)

    def free_unused(self, in_use: Collection[int]) -> None:
        """Free the weights of unloaded adapters that no request uses (the step loop's
        thread, between steps)."""
        if not self._retired:
            return
        with self._lock:
            done = self._retired - set(in_use)
            self._retired -= done
        for slot in done:
            self._remove(slot)
