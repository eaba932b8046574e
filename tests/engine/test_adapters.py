"""engine/adapters.py: LoRA adapters by name and slot, loaded, refused and freed."""

from __future__ import annotations

import pytest

from predictor.engine.adapters import Adapters
from predictor.errors import CheckpointError, InvalidRequest, ModelMissing


def test_slots_are_never_reused_and_freed_only_when_unused() -> None:
    installed: dict[int, str] = {}
    freed: list[int] = []

    def read(name: str, path: str) -> str:
        if path == "bad":
            raise CheckpointError(f"adapter '{name}': no adapter_config.json")
        return name

    adapters = Adapters(read, installed.__setitem__, freed.append, limit=2)
    assert adapters.load("a", "/a").slot == 1 and adapters.load("b", "/b").slot == 2
    with pytest.raises(InvalidRequest, match="already loaded"):
        adapters.load("a", "/a")
    with pytest.raises(InvalidRequest, match="max-cpu-loras"):
        adapters.load("c", "/c")
    adapters.unload("a")
    assert adapters.slot("a") is None and adapters.retiring()
    adapters.free_unused({1})  # a request still runs with it
    assert freed == []
    adapters.free_unused(set())
    assert freed == [1] and not adapters.retiring()
    with pytest.raises(CheckpointError):
        adapters.load("c", "bad")
    assert adapters.load("c", "/c").slot == 3  # a failed read takes no slot; freed 1 is not reused
    with pytest.raises(ModelMissing):
        adapters.unload("a")
    assert adapters.names() == {2: "b", 3: "c"}
