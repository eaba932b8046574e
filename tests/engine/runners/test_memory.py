"""engine/runners/memory.py: the weights' file pages given back stay readable; module tensors
emptied; the heap trim runs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from predictor.engine.runners import memory


def test_released_mapped_weights_read_back_the_same(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    values = np.arange(1 << 20, dtype=np.float32) % 251
    values.tofile(path)
    mapped = np.memmap(path, dtype=np.float32, mode="c")  # a private mapping, as torch's
    tensor = torch.from_numpy(mapped)
    assert torch.equal(tensor, torch.from_numpy(values))
    ranges = memory.mapped_ranges()
    assert any(start <= tensor.data_ptr() < end for start, end in ranges)
    assert memory.release_mapped_weights() >= values.nbytes
    assert torch.equal(tensor, torch.from_numpy(values))  # faulted in again from the file
    tensor[0] = -1.0  # a written page (copy-on-write): kept, the others given back
    (whole,) = [r for r in memory.mapped_ranges() if r[0] <= tensor.data_ptr() < r[1]]
    float(tensor.sum())  # every page resident again
    runs = memory.clean_runs(*whole)
    assert runs and all(not (low <= tensor.data_ptr() < high) for low, high in runs)
    memory.release_mapped_weights()
    assert float(tensor[0]) == -1.0
    assert torch.equal(tensor[1:], torch.from_numpy(values[1:]))
    memory.trim_heap()


def test_only_private_mappings_of_the_suffix_count(tmp_path: Path) -> None:
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f10 r--p 00000000 08:01 1 /m/model.safetensors\n"
        "7f10-7f20 r--s 00000000 08:01 1 /m/other.safetensors\n"
        "7f20-7f30 r-xp 00000000 08:01 2 /usr/lib/libc.so.6\n"
        "7f30-7f40 rw-p 00000000 00:00 0\n"
    )
    assert memory.mapped_ranges(maps=maps) == [(0x7F00, 0x7F10)]
    assert memory.mapped_ranges(maps=tmp_path / "missing") == []


def test_empty_tensors_empties_buffers_parameters_and_attributes() -> None:
    module = torch.nn.Linear(4, 3)
    module.register_buffer("codes", torch.ones(5, dtype=torch.uint8))
    module.table = torch.ones(7, dtype=torch.int32)
    memory.empty_tensors(module)
    assert module.weight.numel() == 0 and module.weight.dtype == torch.float32
    codes = module.get_buffer("codes")
    assert codes.numel() == 0 and codes.dtype == torch.uint8
    assert module.table.numel() == 0 and module.table.dtype == torch.int32
