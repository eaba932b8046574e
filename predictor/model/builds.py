"""Where a finished build goes: installed at OUT with its report (quality.json), or, refused by
a quality gate, kept at OUT.rejected with the report and the reason, so that the hour it took
is not lost: `quantize --accept-rejected OUT.rejected` installs it as it is, recomputing
nothing (a user who judges the figures good enough for their use, or who wants to serve it
with other kernels)."""

from __future__ import annotations

import datetime
import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # a type only: the builds' bookkeeping loads no model code
    from predictor.model.evaluate import QualityReport

QUALITY_FILE = "quality.json"  # the build's evaluation, written into the GPTQ checkpoint
REJECTED = ".rejected"  # OUT.rejected: a build its gate refused
WORST_MODULES = 10  # the modules with the largest GPTQ loss a report keeps


def install(staged: Path, out: Path) -> None:
    """`staged` moved to `out`, replacing what was there, readable as the umask allows: the
    writers (gptqmodel's safetensors, temporary folders) left some files 0600, which a server
    running as another user (an image's, a volume's) could not read."""
    mask = os.umask(0)
    os.umask(mask)
    for path in (staged, *staged.rglob("*")):
        if not path.is_symlink():
            path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)
    if out.exists():
        shutil.rmtree(out)
    staged.rename(out)


def write_report(folder: Path, quality: dict[str, Any]) -> None:
    (folder / QUALITY_FILE).write_text(json.dumps(quality, indent=2) + "\n")


def quality_refusal(report: QualityReport, max_ratio: float) -> str | None:
    """Why the gate refuses the checkpoint (the perplexity ratio missing or past the bar), with
    the figures; None where it passes."""
    if report.ratio is None or report.reference is None:
        return "quality gate: the checkpoint was not compared with a reference"
    if not report.ratio <= max_ratio:
        return (
            f"quality gate failed: perplexity ratio {report.ratio:.3f} on the test text "
            f"(GPTQ {report.checkpoint.perplexity:.2f} / fp {report.reference.perplexity:.2f}) "
            f"is past the bar {max_ratio:.2f} (MAX_PPL_RATIO for make model, --max-ratio here)"
        )
    return None


def rejected_path(out: Path) -> Path:
    return out.with_name(out.name + REJECTED)


def keep_rejected(staged: Path, out: Path, quality: dict[str, Any], reason: str) -> Path:
    """The refused build moved to OUT.rejected (replacing an older one) with its report and
    `reason`; returns where it is."""
    target = rejected_path(out)
    write_report(staged, {**quality, "rejected": reason})
    install(staged, target)
    return target


def worst_modules(losses: list[dict[str, Any]]) -> str:
    """The modules that lost the most, for the console: 'layer 3 mlp.down_proj 0.0123, ...'."""
    return ", ".join(
        f"layer {entry['layer']} {entry['module']} {entry['loss']:.4g}" for entry in losses[:5]
    )


def accept_rejected(rejected: Path, out: Path | None = None) -> Path:
    """Install a build kept at `rejected` at `out` (default: its folder without `.rejected`),
    its report marked accepted, with the reason it was refused; returns where it went.
    SystemExit naming why where `rejected` is not a kept build."""
    if not (rejected / QUALITY_FILE).is_file():
        raise SystemExit(
            f"--accept-rejected {rejected}: not a build a gate refused (it has no {QUALITY_FILE})"
        )
    try:
        quality = json.loads((rejected / QUALITY_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(
            f"--accept-rejected {rejected}: no readable {QUALITY_FILE} ({exc})"
        ) from exc
    if not isinstance(quality, dict) or "rejected" not in quality:
        raise SystemExit(
            f"--accept-rejected {rejected}: not a build a gate refused "
            f"(its {QUALITY_FILE} records no rejection)"
        )
    if not (rejected / "quantize_config.json").is_file() or not any(rejected.glob("*.safetensors")):
        raise SystemExit(f"--accept-rejected {rejected}: its checkpoint files are missing")
    if out is None:
        if not rejected.name.endswith(REJECTED):
            raise SystemExit(f"--accept-rejected {rejected}: name the folder to install with --out")
        out = rejected.with_name(rejected.name.removesuffix(REJECTED))
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    quality["accepted"] = {"refused_for": quality.pop("rejected"), "at": now}
    write_report(rejected, quality)
    install(rejected, out)
    return out


def recorded_kernel(checkpoint: Path) -> str | None:
    """The kernel the checkpoint's build chose to be served with (quality.json's `serve`,
    written where the autotune's kernels failed the served gate and a precise one passed);
    None where it chose none or has no readable report."""
    try:
        quality = json.loads((checkpoint / QUALITY_FILE).read_text())
        kernel = quality["serve"]["kernel"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return kernel if isinstance(kernel, str) else None
