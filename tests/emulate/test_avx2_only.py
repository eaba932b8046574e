"""emulate.avx2_only: a command sees an AVX2-only CPU (flags, compiler, torch), nothing else does."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from emulate import avx2_only
from predictor.toolchain import cpu_flags

REPO = Path(__file__).resolve().parents[2]

CPUINFO = """processor\t: 0
model name\t: Some CPU
flags\t\t: fpu avx avx2 fma f16c avx512f avx512bw avx512_vnni avx_vnni amx_tile vaes gfni sha_ni
vmx flags\t: vnmi ept avx512_keep
bugs\t\t: spectre_v1

processor\t: 1
model name\t: Some CPU
flags\t\t: fpu avx avx2 fma f16c avx512f avx512bw avx512_vnni avx_vnni amx_tile vaes gfni sha_ni
"""

# run as on an AVX2-only CPU: what it sees of the CPU, the compiler and torch, then exit 3
PROBE = """
import json, os, subprocess, torch
from emulate.avx2_only import HELD
from predictor.engine.runners.native import bindings as native
from predictor.toolchain import compiler, cpu_flags
macros = subprocess.run([compiler(), "-march=native", "-dM", "-E", "-"], input="",
                        capture_output=True, text=True).stdout
print(json.dumps({"flags": sorted(cpu_flags()), "isas": native.usable_isas(),
                  "macros": [m for m in ("__AVX2__", "__AVX512F__") if m in macros],
                  "capability": torch.backends.cpu.get_cpu_capability(),
                  "env": {name: os.environ.get(name) for name in (*HELD, "CC")}}))
raise SystemExit(3)
"""


def test_the_wider_flags_of_every_processor_are_held_back_and_nothing_else() -> None:
    held = avx2_only.held_cpuinfo(CPUINFO)
    flags = [line for line in held.splitlines() if line.startswith("flags")]
    assert flags == ["flags\t\t: fpu avx avx2 fma f16c sha_ni"] * 2
    others = [line for line in held.splitlines() if not line.startswith("flags")]
    assert others == [line for line in CPUINFO.splitlines() if not line.startswith("flags")]
    assert avx2_only.hidden_flags(CPUINFO) == [
        "amx_tile", "avx512_vnni", "avx512bw", "avx512f", "avx_vnni", "gfni", "vaes",
    ]  # fmt: skip
    assert avx2_only.hidden_flags(held) == []


def test_the_wrapper_asks_for_the_named_cpu_and_passes_the_rest_as_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    echo = tmp_path / "my cc"  # a compiler that prints its arguments, one a line
    echo.write_text('#!/bin/sh\nfor arg do printf "%s\\n" "$arg"; done\n')
    echo.chmod(0o755)
    monkeypatch.setenv("CC", str(echo))
    monkeypatch.delenv(avx2_only.REAL_CC, raising=False)  # (set where the suite runs under it)
    _, wrapper, real = avx2_only.prepare(tmp_path / "held", "znver1")
    assert real == str(echo)
    given = ["-O3", "-march=native", "a file.c", "-o", "-march=nativex", ""]
    done = subprocess.run([wrapper, *given], capture_output=True, text=True, check=True)
    assert done.stdout.split("\n")[:-1] == ["-O3", "-march=znver1", *given[2:]]
    monkeypatch.setenv("CC", str(wrapper))  # a run inside a run wraps what the outer one wraps
    with pytest.raises(SystemExit, match="own wrapper"):
        avx2_only.prepare(tmp_path / "held", "znver1")
    monkeypatch.setenv(avx2_only.REAL_CC, str(echo))
    assert avx2_only.prepare(tmp_path / "held", "znver1")[2] == str(echo)


def test_the_command_sees_an_avx2_only_cpu_and_its_exit_code_is_returned(tmp_path: Path) -> None:
    if not {"avx2", "fma"} <= cpu_flags():
        pytest.skip("not an x86 CPU with AVX2")
    cpuinfo, _, _ = avx2_only.prepare(tmp_path, "znver1")
    why_not = avx2_only.can_hold(cpuinfo)
    if why_not is not None:
        pytest.skip(why_not)
    before = cpu_flags()
    done = subprocess.run(
        [sys.executable, "-m", "emulate.avx2_only", "--", sys.executable, "-c", PROBE],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 3, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(seen["flags"]) == {f for f in before if not f.startswith(avx2_only.WIDER)}
    assert seen["isas"] == ["avx2"]  # the runner's matmuls: no AVX-512 or VNNI build
    assert seen["macros"] == ["__AVX2__"]  # -march=native: AVX2, not AVX-512
    assert seen["capability"] == "AVX2"  # torch's kernels
    assert {name: seen["env"][name] for name in avx2_only.HELD} == avx2_only.HELD
    assert Path(seen["env"]["CC"]).name == "cc-znver1"
    assert "exit 3 after" in done.stderr and "-march=znver1" in done.stderr
    assert cpu_flags() == before  # held for the command only


def test_where_no_mount_namespace_can_be_made_it_refuses_and_runs_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "unshare").write_text(
        "#!/bin/sh\necho 'unshare: Operation not permitted' >&2\nexit 1\n"
    )
    (bin_dir / "unshare").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{Path(sys.executable).parent}:/usr/bin:/bin")
    ran = tmp_path / "ran"
    code = avx2_only.run(["touch", str(ran)], folder=tmp_path / "held")
    assert code == 2 and not ran.exists()
    assert "refused: no mount namespace here" in capsys.readouterr().err


def test_a_command_is_required() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "emulate.avx2_only"], cwd=REPO, capture_output=True, text=True
    )
    assert done.returncode == 2 and "a command is needed" in done.stderr
