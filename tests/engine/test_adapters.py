"""engine/adapters.py: LoRA adapters by name and slot: registered, resident within the limit,
evicted least recently used first but never while in use, refused and freed."""

from __future__ import annotations

import pytest

from predictor.engine.adapters import Adapters
from predictor.errors import CheckpointError, InvalidRequest, ModelMissing


def make(limit: int) -> tuple[Adapters, dict[int, str], list[int]]:
    installed: dict[int, str] = {}
    freed: list[int] = []

    def read(name: str, path: str) -> str:
        if path == "bad":
            raise CheckpointError(f"adapter '{name}': no adapter_config.json")
        return name

    return Adapters(read, installed.__setitem__, freed.append, limit=limit), installed, freed


def test_slots_are_never_reused_and_freed_only_when_unused() -> None:
    adapters, installed, freed = make(limit=0)
    assert adapters.load("a", "/a") == 1 and adapters.load("b", "/b") == 2
    assert installed == {1: "a", 2: "b"}
    with pytest.raises(InvalidRequest, match="already loaded"):
        adapters.load("a", "/a")
    adapters.unload("a")
    assert adapters.slot("a") is None and not adapters.registered("a") and adapters.retiring()
    adapters.free_unused(lambda: {1})  # a request still runs with it
    assert freed == []
    adapters.free_unused(set)
    assert freed == [1] and not adapters.retiring()
    with pytest.raises(CheckpointError):
        adapters.load("c", "bad")
    assert not adapters.registered("c")  # a failed read registers nothing and takes no slot
    assert adapters.load("c", "/c") == 3  # freed 1 is not reused
    with pytest.raises(ModelMissing):
        adapters.unload("a")
    assert adapters.names() == {2: "b", 3: "c"}


def test_beyond_the_limit_the_least_recently_used_unused_adapter_is_evicted() -> None:
    adapters, installed, freed = make(limit=2)
    assert adapters.load("a", "/a") == 1 and adapters.load("b", "/b") == 2
    assert adapters.load("c", "/c") is None  # registered, read and checked; not resident
    assert adapters.registered("c") and adapters.slot("c") is None and adapters.path("c") == "/c"
    assert adapters.slot("a") == 1  # a is now the most recently used: b goes first
    slot = adapters.reserve(in_use=set())
    assert slot == 3 and adapters.resident() == ["a"] and adapters.slot("b") is None
    adapters.install(slot, adapters.read("c", "/c"))
    adapters.commit("c", slot)
    assert adapters.resident() == ["a", "c"] and installed[3] == "c"
    adapters.free_unused(set)
    assert freed == [2]  # b's weights, once unused
    # a request uses a (the least recent): c is evicted in its place, never a
    slot = adapters.reserve(in_use={1})
    assert slot == 4 and adapters.resident() == ["a"]
    adapters.commit("b", slot)
    # both resident adapters in use: no room, nothing evicted
    assert adapters.reserve(in_use={1, 4}) is None and adapters.resident() == ["a", "b"]
    assert adapters.names() == {1: "a", 3: "c", 4: "b"}  # c retired, not yet freed


def test_an_adapter_unloaded_or_failed_while_being_installed_is_freed() -> None:
    adapters, _, freed = make(limit=1)
    adapters.load("a", "/a")
    adapters.load("b", "/b")
    slot = adapters.reserve(in_use=set())
    assert slot is not None
    adapters.unload("b")  # while its weights were being read again
    adapters.commit("b", slot)
    assert adapters.resident() == [] and adapters.retiring()
    slot = adapters.reserve(in_use=set())
    assert slot is not None
    adapters.release(slot)  # its install failed
    adapters.free_unused(set)
    assert sorted(freed) == [1, 2, 3] and adapters.names() == {}
