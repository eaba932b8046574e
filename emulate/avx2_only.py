"""Run a command as on an AVX2-only CPU (no AVX-512, AMX or AVX-VNNI) on a CPU that has them.

    python -m emulate.avx2_only -- make test

An AVX2-only CPU (an AMD EPYC Zen 1, say) changes three choices here, each held back for the
command and every process it starts:

- torch, oneDNN and MKL pick their kernels by CPUID: `ATEN_CPU_CAPABILITY=avx2`,
  `ONEDNN_MAX_CPU_ISA=AVX2` and `MKL_ENABLE_INSTRUCTIONS=AVX2` (bf16 is then emulated, and
  oneDNN refuses its bf16 prepack, as there);
- the runner's matmuls and the model builder's kernels pick their instruction sets from the
  flags in /proc/cpuinfo (predictor/toolchain.py: `cpu_flags`): the command runs in a mount
  namespace of its own (`unshare --mount`, root only) where a copy of /proc/cpuinfo without the
  wider flags (`WIDER`) is mounted over it;
- gcc's `-march=native` asks CPUID: `$CC` is a wrapper that passes `-march=znver1` (`--march`)
  in its place to the compiler `$CC` named before (predictor/toolchain.py: `compiler`).

Where the namespace cannot be made (not root, no `unshare`) it refuses rather than run with one
of the three held back and not the others. Only instruction sets are held back, not speed: a
Zen 1 also runs a lower clock and splits each 256-bit operation in two (`emulate.half_speed`
stands in for a slower CPU); a figure measured under it is an estimate, named as one.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from predictor.toolchain import compiler

# The flags of vector extensions beyond AVX2 (prefixes): AVX-512 and its kin, AMX, the VEX-coded
# AVX-VNNI/IFMA/NE-CONVERT (flags "avx_..."), and the vector AES, carry-less multiply and GF2
# instructions that came with them. An AVX2-only x86 CPU lists "avx", "avx2", "fma", "f16c".
WIDER = ("avx512", "amx", "avx_", "vaes", "vpclmulqdq", "gfni")
HELD = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
}
CPUINFO = Path("/proc/cpuinfo")
# The compiler the wrapper stands in for, for a run inside a run (whose $CC is the wrapper).
REAL_CC = "AVX2_ONLY_CC"
# Mounts the copy over /proc/cpuinfo, in the namespace unshare made, then becomes the command.
MOUNT = 'mount --bind "$0" /proc/cpuinfo && exec "$@"'
WRAPPER = """#!/bin/sh
# emulate.avx2_only: {real} with -march={march} wherever -march=native is asked for
for arg do
    shift
    if [ "$arg" = "-march=native" ]; then arg="-march={march}"; fi
    set -- "$@" "$arg"
done
exec {real} "$@"
"""


def held_cpuinfo(text: str) -> str:
    """/proc/cpuinfo's text without the WIDER flags on its `flags` lines (one a processor)."""
    lines = []
    for line in text.splitlines(keepends=True):
        key, colon, value = line.partition(":")
        if colon and key.strip() == "flags":
            kept = [flag for flag in value.split() if not flag.startswith(WIDER)]
            line = f"{key}: {' '.join(kept)}\n"
        lines.append(line)
    return "".join(lines)


def hidden_flags(text: str) -> list[str]:
    """The WIDER flags /proc/cpuinfo's text lists, sorted."""
    flags = {
        flag
        for line in text.splitlines()
        if line.partition(":")[0].strip() == "flags"
        for flag in line.partition(":")[2].split()
    }
    return sorted(flag for flag in flags if flag.startswith(WIDER))


def prepare(folder: Path, march: str) -> tuple[Path, Path, str]:
    """The held copy of /proc/cpuinfo and the compiler wrapper, written into `folder` (the same
    paths each run, so that the kernels' caches, keyed by the compiler's path, keep), and the
    compiler it wraps."""
    folder.mkdir(parents=True, exist_ok=True)
    cpuinfo, wrapper = folder / "cpuinfo", folder / f"cc-{march}"
    real = _real_compiler(wrapper)
    _write(cpuinfo, held_cpuinfo(CPUINFO.read_text()), mode=0o644)
    _write(wrapper, WRAPPER.format(real=shlex.quote(real), march=march), mode=0o755)
    return cpuinfo, wrapper, real


def _real_compiler(wrapper: Path) -> str:
    """The compiler the kernels would use, as a path: `$CC`'s (predictor/toolchain.py), or the
    one a run this command runs in wraps."""
    path = os.environ.get(REAL_CC) or shutil.which(compiler()) or compiler()
    if Path(path).resolve() == wrapper.resolve():
        raise SystemExit(f"$CC is this tool's own wrapper ({wrapper}) and {REAL_CC} is not set")
    return path


def _write(path: Path, text: str, mode: int) -> None:
    """`text` into `path`, whole, unless it holds it already: a file a run has mounted over
    /proc/cpuinfo is never replaced (a run inside it could not mount over a deleted one)."""
    if path.is_file() and path.read_text() == text:
        return
    staging = path.with_suffix(f".{os.getpid()}.tmp")
    staging.write_text(text)
    staging.chmod(mode)
    os.replace(staging, path)


def environment(base: dict[str, str], wrapper: Path, real: str) -> dict[str, str]:
    """`base` with torch, oneDNN and MKL held to AVX2, and $CC the wrapper of `real`."""
    return {**base, **HELD, "CC": str(wrapper), REAL_CC: real}


def namespaced(cpuinfo: Path, command: Sequence[str]) -> list[str]:
    """`command` in a mount namespace of its own where `cpuinfo` is /proc/cpuinfo."""
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", MOUNT, str(cpuinfo),
            *command]  # fmt: skip


def can_hold(cpuinfo: Path) -> str | None:
    """None where a mount namespace with the held /proc/cpuinfo can be made, else why not."""
    try:
        probe = subprocess.run(namespaced(cpuinfo, ["true"]), capture_output=True, text=True)
    except OSError as error:
        return f"unshare could not run: {error}"
    if probe.returncode != 0:
        return f"no mount namespace here (root is needed): {probe.stderr.strip()}"
    return None


def run(command: Sequence[str], march: str = "znver1", folder: Path | None = None) -> int:
    """`command`'s exit code, run as on an AVX2-only CPU; its wall time on stderr."""
    folder = folder or Path(tempfile.gettempdir()) / f"avx2-only-{os.getuid()}"
    cpuinfo, wrapper, real = prepare(folder, march)
    why_not = can_hold(cpuinfo)
    if why_not is not None:
        print(f"[avx2_only] refused: {why_not}", file=sys.stderr, flush=True)
        return 2
    hidden = hidden_flags(CPUINFO.read_text())
    print(f"[avx2_only] /proc/cpuinfo without {' '.join(hidden) or 'nothing (none listed)'}; "
          f"-march={march} for -march=native; torch, oneDNN and MKL held to AVX2: "
          f"{' '.join(command)}", file=sys.stderr, flush=True)  # fmt: skip
    started = time.monotonic()
    code = subprocess.call(
        namespaced(cpuinfo, command), env=environment(dict(os.environ), wrapper, real)
    )
    seconds = time.monotonic() - started
    print(f"[avx2_only] exit {code} after {seconds:.0f} s", file=sys.stderr, flush=True)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m emulate.avx2_only", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument(
        "--march", default="znver1", help="what -march=native becomes (gcc's names)"
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("a command is needed: python -m emulate.avx2_only -- make test")
    return run(command, march=args.march)


if __name__ == "__main__":
    raise SystemExit(main())
