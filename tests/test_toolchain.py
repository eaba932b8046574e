"""predictor.toolchain: a C source built, loaded with the GIL kept or released, cached, and a
clear NativeUnavailable where it cannot be built."""

from __future__ import annotations

import ctypes
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from predictor import toolchain
from predictor.errors import NativeUnavailable

needs_compiler = pytest.mark.skipif(
    not any(shutil.which(cc) for cc in ("cc", "gcc", "g++", "clang")), reason="no C compiler"
)

# Calls back into Python's PyGILState_Check: 1 while the calling thread holds the GIL.
SOURCE = """
typedef int (*check_fn)(void);
int holds_gil(check_fn check) { return check(); }
"""


def _source(folder: Path, text: str = SOURCE) -> Path:
    path = folder / "probe.c"
    path.write_text(text)
    return path


def _holds_gil(library: ctypes.CDLL) -> int:
    check = ctypes.cast(ctypes.pythonapi.PyGILState_Check, ctypes.c_void_p)
    library.holds_gil.argtypes = [ctypes.c_void_p]
    return int(library.holds_gil(check))


@needs_compiler
def test_a_cdll_call_releases_the_gil_and_a_pydll_call_keeps_it(tmp_path: Path) -> None:
    source = _source(tmp_path)
    assert _holds_gil(toolchain.build(source, ["-O2"], loader=ctypes.CDLL)) == 0
    assert _holds_gil(toolchain.build(source, ["-O2"], loader=ctypes.PyDLL)) == 1
    assert _holds_gil(toolchain.build(source, ["-O2"])) == 1  # the runner's default


@needs_compiler
def test_a_source_that_does_not_compile_is_unavailable_with_the_compilers_words(
    tmp_path: Path,
) -> None:
    source = _source(tmp_path, "int broken( {")
    with pytest.raises(NativeUnavailable, match="failed: .*error"):
        toolchain.build(source, ["-O2"])


def test_without_a_compiler_nothing_is_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with pytest.raises(NativeUnavailable, match="no C compiler"):
        toolchain.build(_source(tmp_path), ["-O2"])


def test_an_optional_build_that_cannot_be_made_is_none_and_says_what_runs_instead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with caplog.at_level("INFO", logger="predictor.toolchain"):
        assert toolchain.build_or_none(_source(tmp_path), ["-O2"], "torch runs it") is None
    assert "torch runs it: no C compiler" in caplog.text
    monkeypatch.delenv("CC")
    if any(shutil.which(cc) for cc in ("cc", "gcc", "g++", "clang")):
        library = toolchain.build_or_none(_source(tmp_path), ["-O2"], "torch runs it")
        assert library is not None and _holds_gil(library) == 0  # a CDLL by default


@needs_compiler
def test_a_cached_build_is_loaded_without_compiling(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source, cache = _source(tmp_path), tmp_path / "cache"
    toolchain.build(source, ["-O2"], ["-DONE=1"], cache_dir=cache)
    assert len(list(cache.glob("probe-*.so"))) == 1

    def no_build(*args: Any, **kwargs: Any) -> None:
        raise OSError("no temporary folder")

    monkeypatch.setattr("tempfile.TemporaryDirectory", no_build)  # only a cache hit succeeds
    assert _holds_gil(toolchain.build(source, ["-O2"], ["-DONE=1"], cache_dir=cache)) == 1
    with pytest.raises(NativeUnavailable, match="no temporary folder"):  # other flags: a miss
        toolchain.build(source, ["-O2"], ["-DONE=2"], cache_dir=cache)


@needs_compiler
def test_a_header_from_another_folder_is_found_and_an_edit_of_it_rebuilds(tmp_path: Path) -> None:
    """The runner's kernels include native_common.h: found wherever the source lies (a test's
    copy of a kernel), and part of the cache key (the source alone has not changed)."""
    header, folder = tmp_path / "include" / "value.h", tmp_path / "source"
    header.parent.mkdir()
    folder.mkdir()
    source = _source(folder, '#include "value.h"\nint value(void) { return VALUE; }\n')
    cache = tmp_path / "cache"

    def value() -> int:
        return int(toolchain.build(source, ["-O2"], cache_dir=cache, headers=[header]).value())

    header.write_text("#define VALUE 1\n")
    assert value() == 1
    header.write_text("#define VALUE 2\n")
    assert value() == 2
    assert len(list(cache.glob("probe-*.so"))) == 2


@needs_compiler
def test_builds_of_one_library_at_once_compile_it_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two starts on one cache at once (two servers; the test workers' first servers): one
    compiles, the other waits for it and loads what it kept. Threads open the lock file each,
    as processes do (a flock belongs to an open file)."""
    real = next(shutil.which(cc) for cc in ("cc", "gcc", "g++", "clang") if shutil.which(cc))
    calls, wrapper = tmp_path / "calls", tmp_path / "slow-cc"
    wrapper.write_text(  # a compiler that logs each build and takes its time
        f'#!/bin/sh\ncase "$*" in *-shared*) echo build >> {calls}; sleep 0.5;; esac\n'
        f'exec {real} "$@"\n'
    )
    wrapper.chmod(0o755)
    monkeypatch.setenv("CC", str(wrapper))
    source, cache = _source(tmp_path), tmp_path / "cache"
    with ThreadPoolExecutor(2) as pool:
        built = list(pool.map(lambda _: toolchain.build(source, ["-O2"], cache_dir=cache), "ab"))
    assert [_holds_gil(library) for library in built] == [1, 1]
    assert calls.read_text().split() == ["build"]


def test_the_cpu_is_named_from_proc_cpuinfo() -> None:
    if not Path("/proc/cpuinfo").is_file():
        pytest.skip("no /proc/cpuinfo")
    assert toolchain.cpu_model() != "unknown"
    assert toolchain.cpu_flags()  # x86 and arm kernels both list flags ("fpu", "fp", ...)
