"""load/bench_engine.py on the tiny GPTQ model, in process: its batch-size table alone."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from load import bench_engine


def test_batch_sizes_alone_without_sequential_generate_or_poisson_arrivals(
    tiny_gptq_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--sequential-requests 0 --poisson-requests 0` measures the batch sizes only: no ratio
    column without the sequential base (it divided by zero), no arrivals (a median of none)."""
    argv = [
        "bench_engine.py", "--model-dir", str(tiny_gptq_dir), "--threads", "1", "--new-tokens",
        "4", "--concurrency", "1", "2", "--sequential-requests", "0", "--poisson-requests", "0",
        "--device", "cpu",
    ]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    bench_engine.main()
    out = capsys.readouterr().out
    assert "sequential generate" not in out and "Poisson arrivals" not in out
    rows = [line.split() for line in out.split("x sequential")[1].splitlines()]
    rows = [row for row in rows if len(row) == 3 and row[0].isdigit()]
    assert [row[0] for row in rows] == ["1", "2"]
    assert all(float(row[1]) > 0 and row[2] == "-" for row in rows)
