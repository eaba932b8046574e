from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from predictor.config import LOADER_KERNELS, RUNNER_KERNELS, Settings
from predictor.engine.runners.cpu import ModelRunner
from predictor.engine.step import StepRow
from predictor.errors import CheckpointError
from predictor.model.loader import LoadedModel, check_checkpoint, load_checkpoint
from tests.support import ServerProcess, run_predictor, tune_cache


def test_dense_checkpoint_is_not_gptq(tiny_dense_dir: Path) -> None:
    with pytest.raises(CheckpointError, match="not a GPTQ checkpoint"):
        check_checkpoint(tiny_dense_dir)


def test_gptq_checkpoint_loads_with_cpu_kernels(tiny_gptq_dir: Path) -> None:
    assert check_checkpoint(tiny_gptq_dir)["bits"] == 4
    loaded = load_checkpoint(tiny_gptq_dir, device="auto", threads=1)
    assert loaded.device.type == "cpu"
    assert loaded.kernel != "none"  # Linear layers were replaced by a gptqmodel kernel
    assert loaded.tokenizer.chat_template
    assert loaded.eos_ids


@pytest.mark.parametrize("kind", ["missing", "empty", "dense"])
def test_server_refuses_a_folder_that_is_not_gptq(
    kind: str, tmp_path: Path, tiny_dense_dir: Path
) -> None:
    folder = {"missing": tmp_path / "nothing", "empty": tmp_path, "dense": tiny_dense_dir}[kind]
    code, output = run_predictor(["--model-dir", str(folder), "--http-port", "0"])
    assert code == 2
    lines = [line for line in output.splitlines() if line.startswith("predictor:")]
    assert len(lines) == 1 and str(folder) in lines[0]
    assert "Traceback" not in output


def test_broken_config_is_one_clear_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot be read"):
        check_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(
        json.dumps({"quantization_config": {"quant_method": "gptq"}})
    )
    with pytest.raises(CheckpointError, match="no weight files"):
        check_checkpoint(tmp_path)


def greedy_run(model: Any, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and their logits [steps, V] through the engine's runner."""
    runner = ModelRunner(
        model, torch.device("cpu"), num_blocks=8, block_size=16, autotune_cache=tune_cache()
    )
    table = list(range(8))
    logits = runner.forward([StepRow(table, 0, prompt, True)])
    tokens, rows = [], []
    for step in range(steps):
        rows.append(logits[0])
        tokens.append(int(logits[0].argmax()))
        logits = runner.forward([StepRow(table, len(prompt) + step, [tokens[-1]], True)])
    return tokens, torch.stack(rows)


# the loader's kernels; the runner's fused ones (int4_op, native_*, ...): tests/engine/test_runner.py
@pytest.mark.parametrize("kernel", [k for k in LOADER_KERNELS if k != "auto"])
def test_every_kernel_gives_the_default_kernels_greedy_tokens(
    kernel: str, tiny_gptq_dir: Path, tiny_gptq: LoadedModel
) -> None:
    prompt = tiny_gptq.tokenizer.encode("The capital of France is")
    expected, expected_logits = greedy_run(tiny_gptq.model, prompt, 6)
    loaded = load_checkpoint(tiny_gptq_dir, device="cpu", threads=1, kernel=kernel)
    if kernel == "dequantized":
        assert loaded.kernel == "Linear (dequantized)"
        assert not any(type(m).__module__.startswith("gptqmodel") for m in loaded.model.modules())
    else:
        assert loaded.kernel != tiny_gptq.kernel or kernel == "gptq_torch_aten"
    tokens, logits = greedy_run(loaded.model, prompt, 6)
    spread = float(expected_logits.std())
    if kernel == "gptq_torch_int8":
        # re-quantizes the 4-bit weights to int8 per output channel: close, not the same numbers
        assert float((logits - expected_logits).abs().mean()) < 0.1 * spread
    else:
        assert tokens == expected
        assert float((logits - expected_logits).abs().max()) < 0.1 * spread


def test_default_kernel_is_a_known_kernel_and_a_bad_one_is_refused(tiny_gptq_dir: Path) -> None:
    assert Settings().model.kernel in RUNNER_KERNELS
    assert Settings().model.loader_kernel in LOADER_KERNELS
    loads = Settings.from_sources([], {"PREDICTOR_LOADER_KERNEL": "gptq_torch"})
    assert loads.model.loader_kernel == "gptq_torch"
    with pytest.raises(ValueError, match="--kernel must be one of auto, autotune, int4_op"):
        Settings.from_sources([], {"PREDICTOR_KERNEL": "marlin"})
    with pytest.raises(CheckpointError, match="unknown kernel 'marlin' \\(choose one of auto"):
        load_checkpoint(tiny_gptq_dir, device="cpu", kernel="marlin")


def test_server_names_a_bad_kernel_and_exits(tiny_gptq_dir: Path) -> None:
    """--kernel is the runner's, --loader-kernel the loader's: a loader's kernel given to
    --kernel (the one flag named both before) is refused naming the flag it belongs to."""
    code, output = run_predictor(["--model-dir", str(tiny_gptq_dir), "--kernel", "fast"])
    assert code == 2 and "--kernel must be one of auto, autotune, int4_op" in output
    code, output = run_predictor(["--model-dir", str(tiny_gptq_dir), "--kernel", "dequantized"])
    assert code == 2 and "--loader-kernel dequantized" in output
    code, output = run_predictor(["--model-dir", str(tiny_gptq_dir), "--loader-kernel", "fast"])
    assert code == 2
    assert "argument --loader-kernel: invalid choice: 'fast' (choose from 'auto'" in output


def test_server_serves_with_the_kernel_it_was_given(tiny_gptq_dir: Path) -> None:
    with ServerProcess.start(
        tiny_gptq_dir, "tiny", extra=["--loader-kernel", "dequantized"]
    ) as srv:
        body = {"text_input": "The capital of France is", "parameters": {"max_tokens": 4}}
        r = httpx.post(f"{srv.base_url}/v2/models/tiny/generate", json=body, timeout=60)
        log = srv.log()
    assert r.status_code == 200, r.text
    assert r.json()["details"]["generated_tokens"] >= 1
    assert "(kernel Linear (dequantized)," in log


def test_attention_shape_is_read_from_config_json(tmp_path: Path) -> None:
    """What the native attention kernels are compiled for, before the checkpoint loads: head_dim
    as stated or hidden / heads, query heads per KV head (none stated: no grouping), and no
    guess where a multimodal config nests them."""
    from predictor.model.loader import attention_shape

    def shape(config: dict[str, Any]) -> tuple[int, int] | None:
        (tmp_path / "config.json").write_text(json.dumps(config))
        return attention_shape(tmp_path)

    llama = {"hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 32}
    assert shape(llama) == (64, 1)
    assert shape({**llama, "num_key_value_heads": 8, "head_dim": 128}) == (128, 4)
    assert shape({"hidden_size": 576, "num_attention_heads": 9}) == (64, 1)
    assert shape({"text_config": llama}) is None
    (tmp_path / "config.json").write_text("{not json")
    assert attention_shape(tmp_path) is None and attention_shape(tmp_path / "nothing") is None
