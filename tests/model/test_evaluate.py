"""The quality tool (predictor.model.evaluate) and make model's quality gate, on the tiny models."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from predictor.model.evaluate import (
    HELDOUT_TEXT,
    MAX_TOKENS,
    PROMPTS,
    QualityReport,
    checkpoint_kind,
    evaluate,
    main,
)
from predictor.model.quantize import QUALITY_FILE, build_default_model, calibration_texts, gate


@pytest.fixture(scope="module")
def against_source(tiny_gptq_dir: Path, tiny_dense_dir: Path) -> QualityReport:
    """The tiny GPTQ checkpoint scored against the fp checkpoint it was quantized from."""
    return evaluate(tiny_gptq_dir, tiny_dense_dir, threads=1)


def test_heldout_text_is_never_used_for_calibration() -> None:
    heldout = HELDOUT_TEXT.read_text(encoding="utf-8")
    sentences = [s.strip() for s in heldout.replace("\n", " ").split(". ") if len(s.strip()) > 40]
    calibration = "\n".join(calibration_texts())
    assert len(sentences) > 50
    assert not [s for s in sentences if s in calibration]


def test_perplexity_of_a_gptq_checkpoint_is_finite(tiny_gptq_dir: Path) -> None:
    report = evaluate(tiny_gptq_dir, threads=1)
    assert report.checkpoint.kind == "gptq"
    assert report.checkpoint.kernel != "none"
    assert report.checkpoint.tokens == MAX_TOKENS
    assert math.isfinite(report.checkpoint.perplexity) and report.checkpoint.perplexity > 1
    assert report.reference is None and report.ratio is None and report.agreement is None


def test_a_checkpoint_against_itself_has_ratio_one_and_full_agreement(tiny_gptq_dir: Path) -> None:
    report = evaluate(tiny_gptq_dir, tiny_gptq_dir, threads=1)
    assert report.ratio == 1.0
    assert report.agreement == 1.0
    assert report.prompts == len(PROMPTS)
    assert report.compared >= len(PROMPTS)  # every prompt's answer has at least one token


def test_gptq_against_its_fp_source(against_source: QualityReport) -> None:
    assert against_source.reference is not None
    assert against_source.reference.kind == "fp"
    assert against_source.reference.kernel == "float32"
    assert against_source.ratio is not None and math.isfinite(against_source.ratio)
    assert against_source.ratio != 1.0  # 4-bit weights do change the predictions
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


def test_gate_refuses_a_report_without_reference(tiny_gptq_dir: Path) -> None:
    with pytest.raises(SystemExit, match="not compared with a reference"):
        gate(evaluate(tiny_gptq_dir, threads=1), max_ratio=10.0)


def test_cli_prints_a_table_writes_json_and_shows_progress(
    tiny_gptq_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "quality.json"
    args = [str(tiny_gptq_dir), "--reference", str(tiny_gptq_dir), "--out", str(out)]
    assert main([*args, "--tokens", "600", "--window", "256"]) == 0
    printed = capsys.readouterr()
    assert "perplexity ratio 1.000; greedy agreement 100.0%" in printed.out
    assert "[evaluate] perplexity window 3/3" in printed.err
    figures = json.loads(out.read_text())
    assert figures["ratio"] == 1.0 and figures["agreement"] == 1.0
    assert figures["checkpoint"]["tokens"] == 600 and figures["window"] == 256
    assert figures["checkpoint"]["path"] == str(tiny_gptq_dir)


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
    (gptq / QUALITY_FILE).write_text("{}")
    build_default_model(gptq, fp, threads=1)
    assert "already built; nothing to do" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fp", "gptq"]
