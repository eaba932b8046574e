"""The system C compiler and this CPU's facts: what the native kernels are built with.

The runner's kernels (predictor.engine.runners.native.bindings) and the model builder's scale search
(predictor.model.scale_search) are C sources compiled at first use into a shared library and
loaded with ctypes; both take the compiler, the build and this CPU's model name and flags from
here. No torch: callers pass tensors' addresses.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from predictor.errors import NativeUnavailable

logger = logging.getLogger(__name__)


def compiler() -> str:
    """`$CC`, else the first of cc, gcc, g++, clang on the PATH; NativeUnavailable if none."""
    names = [os.environ["CC"]] if os.environ.get("CC") else ["cc", "gcc", "g++", "clang"]
    found = next((name for name in names if shutil.which(name)), None)
    if found is None:
        raise NativeUnavailable(f"no C compiler (none of {', '.join(names)} found)")
    return found


def build(
    source: Path,
    flags: Sequence[str],
    defines: Sequence[str] = (),
    variants: Sequence[Sequence[str]] = (["-march=native"], []),
    cache_dir: Path | None = None,
    loader: Callable[[str], ctypes.CDLL] = ctypes.PyDLL,
    headers: Sequence[Path] = (),
) -> ctypes.CDLL:
    """Compile the C file `source` with `flags` and these -D constants and load it with `loader`:
    the first of `variants` (extra flags) that compiles; by default -march=native first (some
    compilers lack it). `headers`: the files it includes, their folders on the include path.
    With a `cache_dir`, the library is kept there under a digest of the source and its headers,
    the compiler, the flags and this CPU, and loaded from there next time.
    NativeUnavailable (with the compiler's words) when no variant builds or it cannot load.

    A PyDLL's calls keep the GIL (the runner's microsecond kernels: a release per call costs
    more than it frees); a CDLL's release it, for a long call beside other Python threads."""
    cc = compiler()
    folders = dict.fromkeys(header.parent for header in headers)
    compile_flags = [*flags, *(f"-I{folder}" for folder in folders)]
    if cache_dir is None:
        return _compile(cc, source, compile_flags, defines, variants, None, loader)
    digest = build_digest(cc, [*flags, *defines], source, variants, headers)
    cached = cache_dir / f"{source.stem}-{digest}.so"
    with contextlib.suppress(OSError):  # not there yet, or unloadable (noexec): build it
        return loader(str(cached))
    with _building(cached):  # a process building it already: wait, then load what it kept
        with contextlib.suppress(OSError):
            return loader(str(cached))
        return _compile(cc, source, compile_flags, defines, variants, cached, loader)


@contextlib.contextmanager
def _building(cached: Path) -> Iterator[None]:
    """Held while one process builds `cached`: two servers (or test processes) starting at once
    on one cache compile it once, not once each. Without a writable cache folder, no lock."""
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        handle = open(cached.with_suffix(".lock"), "a")  # noqa: SIM115 (held across the yield)
    except OSError:
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _compile(
    cc: str,
    source: Path,
    flags: Sequence[str],
    defines: Sequence[str],
    variants: Sequence[Sequence[str]],
    cached: Path | None,
    loader: Callable[[str], ctypes.CDLL],
) -> ctypes.CDLL:
    try:
        with tempfile.TemporaryDirectory(prefix="gptq-predictor-native-") as folder:
            library = Path(folder) / (source.stem + ".so")
            errors = []
            for arch in variants:
                command = [cc, *flags, *arch, *defines, "-fPIC", "-shared"]
                command += ["-x", "c", str(source), "-o", str(library)]  # C, even to g++
                try:
                    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
                except (OSError, subprocess.TimeoutExpired) as error:
                    raise NativeUnavailable(f"{cc} failed: {error}") from error
                if done.returncode == 0:
                    break
                errors.append(done.stderr.strip()[-500:])
            else:
                raise NativeUnavailable(f"{cc} failed: {' | '.join(errors)}")
            if cached is not None:
                _keep(library, cached)
            return loader(str(library))  # mapped: the file may go with the folder
    except OSError as error:  # no writable temp folder, a noexec one, ...
        raise NativeUnavailable(f"{source.name} could not be built or loaded: {error}") from error


def build_or_none(
    source: Path,
    flags: Sequence[str],
    instead: str,
    loader: Callable[[str], ctypes.CDLL] = ctypes.CDLL,
) -> ctypes.CDLL | None:
    """`build(source, flags, loader=loader)`, or None where it cannot be built here: logged at
    INFO with `instead`, what runs then (the model builder's kernels, each with a torch twin)."""
    try:
        return build(source, flags, loader=loader)
    except NativeUnavailable as error:
        logger.info("%s: %s", instead, error)
        return None


def build_digest(
    cc: str,
    flags: Sequence[str],
    source: Path,
    variants: Sequence[Sequence[str]],
    headers: Sequence[Path] = (),
) -> str:
    """What a cached library was built from: source and headers (their text, not where they
    lie), compiler and version, flags, this CPU."""
    try:
        version = subprocess.run(
            [cc, "-dumpfullversion", "-dumpversion"], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    identity: list[object] = [source.read_text(), shutil.which(cc) or cc, version]
    identity += [header.read_text() for header in headers]
    identity += [list(flags), [list(v) for v in variants], cpu_model(), sorted(cpu_flags())]
    return hashlib.sha256(repr(identity).encode()).hexdigest()[:20]


def _keep(library: Path, target: Path) -> None:
    """Copy the built library into the cache, whole or not at all."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = target.with_suffix(f".{os.getpid()}.tmp")
        shutil.copyfile(library, staging)
        os.replace(staging, target)
    except OSError as error:
        logger.info("native library not cached in %s: %s", target.parent, error)


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo ("unknown" elsewhere)."""
    return _cpuinfo_field("model name") or "unknown"


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    return frozenset(_cpuinfo_field("flags").split())


def _cpuinfo_field(name: str) -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == name:
            return value.strip()
    return ""
