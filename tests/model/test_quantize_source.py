"""`python -m predictor.model.quantize --source`: a user's own fp checkpoint of another family
than the default model's, quantized by the real command line, scored, installed and served."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from predictor.engine.runners.cpu import ModelRunner
from predictor.model.loader import load_checkpoint
from predictor.model.quantize import QUALITY_FILE
from predictor.model.recipe import source_texts
from tests.engine.runners.test_families import PROMPT, greedy, reference_tokens
from tests.support import REPO, built_once, tune_cache


def build_tiny_qwen2(out: Path, tokenizer_dir: Path) -> Path:
    """A random-weight fp32 Qwen2 (biased q, k, v): 2 layers, hidden 128, a real tokenizer."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(7)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # wide logits: few ties between the top tokens
        model.model.embed_tokens.weight.normal_(0.0, 0.5)
        model.lm_head.weight.normal_(0.0, 0.5)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def quantize(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "predictor.model.quantize", *args],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


@pytest.fixture(scope="module")
def qwen2_source(workdir: Path, tokenizer_dir: Path) -> Path:
    return built_once(workdir / "qwen2-fp", lambda out: build_tiny_qwen2(out, tokenizer_dir))


def test_a_users_qwen2_checkpoint_is_quantized_scored_and_served(
    qwen2_source: Path, tmp_path: Path
) -> None:
    out = tmp_path / "qwen2-gptq"
    run = quantize("--source", str(qwen2_source), "--out", str(out), "--group-size", "64",
                   "--texts", "48", "--threads", "1", "--format", "gptq_v2")  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "1/3 GPTQ 4-bit (gptq_v2)" in run.stdout and "(qwen2)" in run.stdout
    assert "2/3 quality" in run.stdout and "3/3 quality as served" in run.stdout
    quant = json.loads((out / "config.json").read_text())["quantization_config"]
    assert (quant["bits"], quant["group_size"], quant["sym"]) == (4, 64, True)
    assert quant["checkpoint_format"] == "gptq_v2"
    quality = json.loads((out / QUALITY_FILE).read_text())
    assert quality["build"]["source"] == str(qwen2_source)
    assert quality["ratio"] <= 1.10  # the default bar held, in process and as served
    served = quality["served"]
    assert served["tokens"] == 512 and served["ratio"] <= 1.10  # half its 1,024-token context
    assert served["ratio"] == pytest.approx(quality["ratio"], rel=0.05)
    loaded = load_checkpoint(out, device="cpu", threads=1)
    runner = ModelRunner(loaded.model, torch.device("cpu"), 64, 16, autotune_cache=tune_cache())
    assert all(f is not None for f in runner._fused)  # its biased q, k, v fused too
    assert greedy(runner, PROMPT, 1) == reference_tokens(out, PROMPT, 1)
    # transformers reads the layout too (its GPTQ config), to the same logits as our reader
    from transformers import AutoModelForCausalLM

    theirs = AutoModelForCausalLM.from_pretrained(out, device_map="cpu")
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        expected = load_checkpoint(out, device="cpu", threads=1).model(ids).logits.float()
        torch.testing.assert_close(theirs(ids).logits.float(), expected, atol=2e-3, rtol=1e-3)


def test_a_source_the_server_cannot_serve_is_refused_at_once(
    qwen2_source: Path, tmp_path: Path
) -> None:
    gemma3 = tmp_path / "gemma3"
    gemma3.mkdir()
    config = json.loads((qwen2_source / "config.json").read_text())
    (gemma3 / "config.json").write_text(json.dumps({**config, "model_type": "gemma3"}))
    started = time.monotonic()
    run = quantize("--source", str(gemma3), "--out", str(tmp_path / "never"))
    assert run.returncode != 0 and "model type 'gemma3' is not supported" in run.stderr
    run = quantize("--source", str(qwen2_source), "--out", str(tmp_path / "never"),
                   "--group-size", "96")  # fmt: skip
    assert run.returncode != 0 and "does not divide hidden_size 128" in run.stderr
    assert time.monotonic() - started < 30  # no weights loaded, no torch import: seconds
    assert not (tmp_path / "never").exists()


def test_source_builds_calibrate_on_every_domain() -> None:
    texts = source_texts()
    assert any(t.startswith("| Region") and "\n|---" in t for t in texts)  # a table
    assert any("shall" in t and "Agreement" in t for t in texts)  # legal
    assert any(t.startswith("User:") for t in texts)  # dialogue
    assert any("import json" in t for t in texts)  # code
    # interleaved: an evenly spaced pick of a third keeps the extra domains
    third = [texts[i * len(texts) // 100] for i in range(100)]
    assert any("|---" in t for t in third) or any("shall" in t for t in third)


def test_a_refused_build_is_kept_and_installed_as_it_is_on_request(
    qwen2_source: Path, tmp_path: Path
) -> None:
    """A bar no build can pass (0.5): the build is kept at OUT.rejected with its report, which
    names the modules that lost the most; --accept-rejected installs it, recomputing nothing."""
    out = tmp_path / "strict"
    run = quantize("--source", str(qwen2_source), "--out", str(out), "--group-size", "64",
                   "--texts", "8", "--threads", "1", "--max-ratio", "0.5")  # fmt: skip
    kept = tmp_path / "strict.rejected"
    assert run.returncode != 0 and not out.exists()
    assert f"Kept with its report at {kept}" in run.stderr, run.stderr[-3000:]
    assert f"--accept-rejected {kept}" in run.stderr and "lost the most: layer " in run.stderr
    quality = json.loads((kept / QUALITY_FILE).read_text())
    assert quality["rejected"].startswith("quality gate failed: perplexity ratio")
    worst = quality["build"]["worst_modules"]
    assert worst and {"layer", "module", "loss"} <= set(worst[0])
    assert "served" not in quality  # the served gate never ran: refused before it
    run = quantize("--accept-rejected", str(qwen2_source))
    assert run.returncode != 0 and "not a build a gate refused" in run.stderr
    started = time.monotonic()
    run = quantize("--accept-rejected", str(kept))
    assert run.returncode == 0, run.stderr[-3000:]
    assert time.monotonic() - started < 30  # moved, not rebuilt
    assert out.is_dir() and not kept.exists()
    quality = json.loads((out / QUALITY_FILE).read_text())
    assert "rejected" not in quality
    assert quality["accepted"]["refused_for"].startswith("quality gate failed")
    loaded = load_checkpoint(out, device="cpu", threads=1)
    assert loaded.model.config.model_type == "qwen2"
