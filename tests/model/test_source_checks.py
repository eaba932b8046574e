"""The served gate's choice (source_checks.served_gate): the autotune's kernels first, and where
they lose too much, the precise kernel, recorded for the server with what it costs."""

from __future__ import annotations

from typing import Any

from predictor.model.source_checks import PRECISE_KERNEL, served_gate


def measuring(ratios: dict[str, float]) -> tuple[list[tuple[str, float | None]], Any]:
    calls: list[tuple[str, float | None]] = []

    def measure(kernel: str | None, reference: float | None) -> dict[str, Any]:
        name = kernel or "auto"
        calls.append((name, reference))
        speed = {"auto": 50.0, PRECISE_KERNEL: 40.0}[name]
        return {"kernel": name, "perplexity": 20 * ratios[name], "reference": 20.0,
                "ratio": ratios[name], "tokens_per_second": speed}  # fmt: skip

    return calls, measure


def test_the_autotunes_kernels_within_the_bar_are_served() -> None:
    calls, measure = measuring({"auto": 1.05, PRECISE_KERNEL: 1.01})
    record, refusal = served_gate(measure, 1.10)
    assert refusal is None and calls == [("auto", None)]  # the precise kernel never measured
    assert record == {"served": measure(None, None)} and "serve" not in record


def test_the_precise_kernel_is_chosen_where_only_it_passes() -> None:
    calls, measure = measuring({"auto": 1.15, PRECISE_KERNEL: 1.04})
    record, refusal = served_gate(measure, 1.10)
    assert refusal is None
    assert calls == [("auto", None), (PRECISE_KERNEL, 20.0)]  # the reference scored once
    serve = record["serve"]
    assert serve["kernel"] == PRECISE_KERNEL and "1.150" in serve["reason"]
    assert serve["tokens_per_second"] == {"auto": 50.0, PRECISE_KERNEL: 40.0}
    assert record["served_precise"]["ratio"] == 1.04


def test_a_build_that_no_kernel_serves_within_the_bar_is_refused() -> None:
    _, measure = measuring({"auto": 1.25, PRECISE_KERNEL: 1.20})
    record, refusal = served_gate(measure, 1.10)
    assert refusal is not None and "1.250" in refusal and "1.200" in refusal
    assert "serve" not in record and record["served_precise"]["ratio"] == 1.20
