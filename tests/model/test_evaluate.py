"""The quality tool (predictor.model.evaluate) and make model's quality gate, on the tiny models."""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from predictor.model import reference_cache
from predictor.model.agreement import PROMPTS, greedy_sequences
from predictor.model.evaluate import QualityReport, evaluate, main
from predictor.model.perplexity import (
    MAX_TOKENS,
    TEST_TEXT,
    TEXTS,
    VALIDATION_TEXT,
    checkpoint_kind,
    load_candidate,
    text_ids,
)
from predictor.model.quantize import QUALITY_FILE, build_default_model, gate
from predictor.model.recipe import DEFAULT_RECIPE, calibration_texts


@pytest.fixture(scope="module")
def against_source(tiny_gptq_dir: Path, tiny_dense_dir: Path) -> QualityReport:
    """The tiny GPTQ checkpoint scored against the fp checkpoint it was quantized from, as
    `make model` scores it: in fp32 (on an AVX2-only CPU the bf16 kernel is emulated, several
    times slower)."""
    return evaluate(  # cache=False: the fixture stays
        tiny_gptq_dir, tiny_dense_dir, threads=1, cache=False, kernel="fp32"
    )


@pytest.fixture(scope="module")
def served_kernel(tiny_gptq_dir: Path) -> QualityReport:
    """The tiny GPTQ checkpoint alone, through the server's kernel: 1,024 tokens of each text."""
    return evaluate(tiny_gptq_dir, threads=1, max_tokens=1024)


def _one_by_one(candidate: Any, prompts: list[str], new_tokens: int) -> list[tuple[list[int], int]]:
    """Each prompt's greedy answer from a generate call of its own, unpadded."""
    import torch

    sequences = []
    for prompt in prompts:
        inputs = candidate.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True,
            return_tensors="pt", return_dict=True,
        )  # fmt: skip
        with torch.inference_mode():
            out = candidate.model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False)
        sequences.append((out[0].tolist(), int(inputs["input_ids"].shape[1])))
    return sequences


def test_greedy_answers_in_one_batch_are_those_one_by_one(tiny_dense_dir: Path) -> None:
    """Left padding changes no answer; a row stops at its end-of-sequence token as a call of its
    own does (here a token the first answer makes is taken as that token)."""
    candidate = load_candidate(tiny_dense_dir, threads=1)
    prompts = ["Hi", "Tell me a long story about a lighthouse keeper and the sea.", "2+2?"]
    messages: list[str] = []
    batched = greedy_sequences(candidate, prompts, 8, messages.append)
    assert batched == _one_by_one(candidate, prompts, 8)
    assert messages == ["greedy answers to 3 prompts, in one batch"]
    assert candidate.tokenizer.padding_side == "right"  # put back
    first, prompt_length = batched[0]
    answer = first[prompt_length:]
    candidate.model.generation_config.eos_token_id = answer[2]
    stopped = greedy_sequences(candidate, prompts, 8, messages.append)
    assert stopped == _one_by_one(candidate, prompts, 8)
    assert stopped[0][0][prompt_length:] == answer[: answer.index(answer[2]) + 1]  # ends there


def _sentences(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    return [s.strip() for s in text.replace("\n", " ").split(". ") if len(s.strip()) > 40]


@pytest.mark.parametrize("path", [VALIDATION_TEXT, TEST_TEXT], ids=["validation", "test"])
def test_evaluation_texts_are_never_used_for_calibration(path: Path) -> None:
    sentences = _sentences(path)
    calibration = "\n".join(calibration_texts())
    assert len(sentences) > 100
    assert not [s for s in sentences if s in calibration]


def test_the_test_text_shares_nothing_with_the_validation_text() -> None:
    validation = VALIDATION_TEXT.read_text(encoding="utf-8")
    assert not [s for s in _sentences(TEST_TEXT) if s in validation]
    assert set(TEXTS.values()) == {VALIDATION_TEXT, TEST_TEXT}


def test_each_text_holds_the_tokens_scored(tokenizer_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    for path in (VALIDATION_TEXT, TEST_TEXT):
        assert len(text_ids(tokenizer, path)) == MAX_TOKENS >= 3000
    with pytest.raises(SystemExit, match="fewer than"):
        text_ids(tokenizer, TEST_TEXT, max_tokens=10**6)


def test_perplexity_of_a_gptq_checkpoint_is_finite(served_kernel: QualityReport) -> None:
    # 1,024 tokens of each text: the whole texts are scored in `against_source`
    report = served_kernel
    assert report.checkpoint.kind == "gptq"
    assert report.checkpoint.kernel != "none"
    assert report.checkpoint.tokens == 1024
    assert math.isfinite(report.checkpoint.perplexity) and report.checkpoint.perplexity > 1
    assert math.isfinite(report.checkpoint.validation_perplexity)
    assert report.checkpoint.validation_perplexity != report.checkpoint.perplexity
    assert report.reference is None and report.ratio is None and report.agreement is None
    assert report.validation_ratio is None


def test_a_checkpoint_against_itself_has_ratio_one_and_full_agreement(tiny_dense_dir: Path) -> None:
    # the fp32 checkpoint: a GPTQ one scores in bf16 through the served kernel (emulated, several
    # times slower, on AVX2-only CPUs); it is scored in test_perplexity_of_a_gptq_checkpoint_...
    report = evaluate(tiny_dense_dir, tiny_dense_dir, threads=1, cache=False, max_tokens=512)
    assert report.ratio == 1.0 and report.validation_ratio == 1.0
    assert report.agreement == 1.0
    assert report.prompts == len(PROMPTS)
    assert report.compared >= len(PROMPTS)  # every prompt's answer has at least one token


def test_gptq_against_its_fp_source(against_source: QualityReport) -> None:
    assert against_source.reference is not None
    assert against_source.checkpoint.tokens == against_source.reference.tokens == MAX_TOKENS
    assert against_source.reference.kind == "fp"
    assert against_source.reference.kernel == "float32"
    assert against_source.checkpoint.kernel == "Linear (fp32, dequantized)"
    assert against_source.ratio is not None and math.isfinite(against_source.ratio)
    assert against_source.ratio != 1.0  # 4-bit weights do change the predictions
    assert against_source.validation_ratio is not None
    assert against_source.validation_ratio != against_source.ratio  # two texts, two figures
    assert against_source.agreement is not None and 0 <= against_source.agreement <= 1


def test_gate_fails_past_the_bar(
    against_source: QualityReport, capsys: pytest.CaptureFixture[str]
) -> None:
    assert against_source.ratio is not None
    with pytest.raises(SystemExit, match="quality gate failed: perplexity ratio .* past the bar"):
        gate(against_source, max_ratio=against_source.ratio * 0.99)
    assert "perplexity ratio" in capsys.readouterr().out  # the figures are printed first


def test_gate_passes_under_the_bar(
    against_source: QualityReport, capsys: pytest.CaptureFixture[str]
) -> None:
    assert against_source.ratio is not None
    shown = gate(against_source, max_ratio=against_source.ratio * 1.01, shown_as=Path("models/x"))
    assert shown.checkpoint.path == "models/x"
    out = capsys.readouterr().out
    assert "models/x" in out and f"perplexity ratio {against_source.ratio:.3f}" in out


def test_gate_refuses_a_report_without_reference(served_kernel: QualityReport) -> None:
    with pytest.raises(SystemExit, match="not compared with a reference"):
        gate(served_kernel, max_ratio=10.0)


def test_cli_prints_a_table_writes_json_and_shows_progress(
    tiny_dense_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "quality.json"  # the fp32 checkpoint, for speed, as in the test above
    args = [str(tiny_dense_dir), "--reference", str(tiny_dense_dir), "--out", str(out)]
    assert main([*args, "--tokens", "600", "--window", "256", "--no-cache"]) == 0
    printed = capsys.readouterr()
    assert "perplexity ratio 1.000 on the test text (1.000 on the validation text)" in printed.out
    assert "greedy agreement 100.0%" in printed.out
    assert "[evaluate] test text: perplexity window 3/3" in printed.err
    assert "[evaluate] validation text: perplexity window 3/3" in printed.err
    figures = json.loads(out.read_text())
    assert figures["ratio"] == 1.0 and figures["agreement"] == 1.0
    assert figures["validation_ratio"] == 1.0 and figures["gated_on"] == "test"
    assert figures["texts"]["test"]["file"] == TEST_TEXT.name
    assert figures["checkpoint"]["tokens"] == 600 and figures["window"] == 256
    assert figures["checkpoint"]["path"] == str(tiny_dense_dir)


def test_the_fp32_kernel_scores_the_same_weights_in_fp32(
    tiny_gptq_dir: Path, served_kernel: QualityReport
) -> None:
    report = evaluate(tiny_gptq_dir, threads=1, kernel="fp32", max_tokens=1024)
    assert report.checkpoint.kernel == "Linear (fp32, dequantized)"
    assert served_kernel.checkpoint.kernel not in ("none", report.checkpoint.kernel)
    # the same 4-bit weights: only the compute precision differs (bf16 kernel vs fp32)
    assert report.checkpoint.perplexity == pytest.approx(
        served_kernel.checkpoint.perplexity, rel=0.02
    )
    assert report.checkpoint.perplexity != served_kernel.checkpoint.perplexity


def test_the_reference_is_scored_once_then_read_from_its_cache_or_the_package(
    tiny_gptq_dir: Path, tiny_dense_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reference = tmp_path / "fp"
    shutil.copytree(tiny_dense_dir, reference)
    (reference / reference_cache.CACHE_FILE).unlink(missing_ok=True)
    messages: list[str] = []
    # short settings, and the candidate in fp32: what is cached matters here, not the figures
    small: dict[str, Any] = {
        "max_tokens": 300,
        "window": 150,
        "prompts": PROMPTS[:2],
        "new_tokens": 4,
        "kernel": "fp32",
    }
    first = evaluate(tiny_gptq_dir, reference, threads=1, progress=messages.append, **small)
    assert (reference / reference_cache.CACHE_FILE).is_file()
    assert not any("cached figures" in m for m in messages)
    messages.clear()
    second = evaluate(tiny_gptq_dir, reference, threads=1, progress=messages.append, **small)
    assert any("cached figures" in m for m in messages)
    assert not any(m.startswith("loading reference") for m in messages)
    assert second.reference is not None and first.reference is not None
    assert second.reference.perplexity == first.reference.perplexity
    assert (second.ratio, second.agreement) == (first.ratio, first.agreement)
    assert (first.reference_figures, second.reference_figures) == (
        "computed",
        "cached: reference.json",
    )
    # the same figures shipped with the package serve a folder without its own cache
    stored = json.loads((reference / reference_cache.CACHE_FILE).read_text())
    monkeypatch.setattr(reference_cache, "SHIPPED", tmp_path / "shipped.json")
    reference_cache.ship(stored["key"], stored["figures"], "here")
    (reference / reference_cache.CACHE_FILE).unlink()
    messages.clear()
    third = evaluate(tiny_gptq_dir, reference, threads=1, progress=messages.append, **small)
    assert third.reference_figures == "shipped: shipped.json"
    assert not any(m.startswith("loading reference") for m in messages)
    assert (third.ratio, third.agreement) == (first.ratio, first.agreement)
    assert third.to_json()["reference_figures"] == "shipped: shipped.json"  # in quality.json
    # other settings are another key: scored again
    messages.clear()
    evaluate(
        tiny_gptq_dir, reference, threads=1, progress=messages.append, **{**small, "window": 100}
    )
    assert any(m.startswith("loading reference") for m in messages)


def test_a_folder_that_is_no_checkpoint_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="no config.json"):
        checkpoint_kind(tmp_path)
    (tmp_path / "config.json").write_text(
        json.dumps({"quantization_config": {"quant_method": "awq"}})
    )
    with pytest.raises(SystemExit, match="'awq' is not supported"):
        checkpoint_kind(tmp_path)


def test_second_build_is_a_no_op(
    tiny_gptq_dir: Path, tiny_dense_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gptq, fp = tmp_path / "gptq", tmp_path / "fp"
    shutil.copytree(tiny_gptq_dir, gptq)
    shutil.copytree(tiny_dense_dir, fp)
    (gptq / QUALITY_FILE).write_text(json.dumps({"build": {"recipe": asdict(DEFAULT_RECIPE)}}))
    build_default_model(gptq, fp, threads=1)
    assert "already built; nothing to do" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fp", "gptq"]
