"""The runner's native kernels, compiled at first use: decode attention (`decode_attention.c`),
the 4-bit GPTQ matmul (`int4_matmul.c`, one build per instruction set the CPU has), the 8-bit
lm_head matmul (`int8_matmul.c`) and a layer's small ops (`layer_ops.c`). The four share
`native_common.h` (bf16 conversions, exp, the vector mappings, the matmuls' tile driver), and
ctypes learns every function they export from one table, `PROTOTYPES`.

torch has no CPU op that attends from a paged cache: the runner's torch path gathers every
decode row's keys and values into a padded copy (one `index_select` a layer) and multiplies
3-row matrices in batched bf16 matmuls, where each small matrix costs more in dispatch than in
arithmetic. The C kernel reads each row's blocks where they lie (load/RESULTS.md, "The decode
step", has the figures).

It is compiled once per process and model shape with the system C compiler (`$CC`, else the
first of cc, gcc, g++, clang), into a temporary file; where no compiler works the
runner keeps its torch path (`--attention torch` forces it). No torch here: the runner passes
tensors' addresses (or tensors, to `DecodeAttention`, which reads their addresses).

The 4-bit matmul is built per instruction set (`ISAS`): AVX-512 F/BW/VL/DQ (16 columns a vector)
and AVX2 + FMA (8), each also with VNNI's int8 dot products (avx512_vnni, avx_vnni), each only
where `/proc/cpuinfo` lists its flags; with OpenMP where the compiler has it (the libgomp.so.1
torch loaded serves both: one pool).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from predictor import toolchain
from predictor.config import NATIVE_ISAS
from predictor.errors import NativeUnavailable
from predictor.toolchain import cpu_flags as cpu_flags
from predictor.toolchain import cpu_model as cpu_model

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode_attention.c")
INT4_SOURCE = Path(__file__).with_name("int4_matmul.c")
LAYER_SOURCE = Path(__file__).with_name("layer_ops.c")
INT8_SOURCE = Path(__file__).with_name("int8_matmul.c")
# What the four include: on the compiler's include path (a source copied elsewhere still finds
# it) and in each library's cache key (an edited header rebuilds them).
HEADER = Path(__file__).with_name("native_common.h")
# instruction set -> (CPU flags it needs, compiler flags, -D constants); widest first
_AVX512 = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mavx2"]
_AVX512_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "avx2")
ISAS: dict[str, tuple[tuple[str, ...], list[str], list[str]]] = {
    "avx512vnni": (
        (*_AVX512_FLAGS, "avx512_vnni"),
        [*_AVX512, "-mavx512vnni"],
        ["-DVW=16", "-DVNNI=1"],
    ),
    "avx512": (_AVX512_FLAGS, _AVX512, ["-DVW=16"]),
    "avx2vnni": (
        ("avx2", "fma", "avx_vnni"),
        ["-mavx2", "-mfma", "-mavxvnni"],
        ["-DVW=8", "-DVNNI=1"],
    ),
    "avx2": (("avx2", "fma"), ["-mavx2", "-mfma"], ["-DVW=8"]),
}
# How the runner's fused int4 projections may run (--kernel forces one; "auto": the autotune
# picks per row count): torch's int4 op, the weights expanded to bf16 and prepacked for oneDNN,
# or int4_matmul.c with fp32 or int8 activations (the widest instruction set, or the one named).
assert tuple(ISAS) == NATIVE_ISAS, "config.NATIVE_ISAS names these instruction sets"
FLAGS = ["-O3", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros"]
# OpenMP first (--threads > 1 splits the rows), then without, each -march=native first
THREADED: tuple[list[str], ...] = (["-march=native", "-fopenmp"], ["-march=native"], [])

# Every function the C sources export, as its prototype with short types: ptr (any pointer: the
# runner passes tensors' addresses), i64 (int64_t), f32 (float), int, size_t, void. The one place
# ctypes learns a signature (`_bind`); tests/engine/runners/native/test_bindings.py checks it
# against the sources.
PROTOTYPES = {
    "decode_attention.c": """
        void decode_attention_bf16(ptr q, i64 q_stride, ptr pool, i64 slots, ptr tables,
                                   i64 table_width, ptr lengths, ptr counts, i64 rows,
                                   i64 kv_heads, f32 scale, ptr out, ptr scratch, i64 threads)""",
    "int4_matmul.c": """
        void int4_repack(ptr codes, ptr scales, ptr zeros, i64 n, i64 k, i64 gs, ptr w)
        void gptq_unpack4(ptr qweight, i64 k, i64 n, ptr order, ptr codes)
        void int4_dequantize(ptr codes, ptr scales, ptr zeros, i64 n, i64 k, i64 gs, i64 stride,
                             ptr out)
        int int4_matmul(ptr x, i64 rows, i64 k, ptr w, i64 n, i64 gs, ptr out, i64 out_stride,
                        i64 threads, i64 int8)
        int int4_vector_width()
        int int4_threaded()""",
    "int8_matmul.c": """
        size_t int8_bytes(i64 n, i64 k)
        void int8_quantize(ptr weights, i64 n, i64 k, ptr w)
        int int8_rows(ptr w, i64 n, i64 k, ptr ids, i64 count, ptr out)
        int int8_matmul(ptr x, i64 rows, i64 k, ptr w, i64 n, ptr out, i64 out_stride,
                        i64 threads, i64 int8)
        int int8_vector_width()""",
    "layer_ops.c": """
        void add_rms_norm(ptr hidden, ptr delta, ptr weight, f32 eps, ptr out, i64 rows, i64 dim,
                          i64 threads)
        void rope_write(ptr qkv, i64 n, i64 heads, i64 kv_heads, ptr cos, ptr sin, ptr pool,
                        i64 slots, ptr slots_of, i64 threads)
        void silu_mul(ptr gate_up, i64 n, i64 inner, ptr out, i64 threads)
        void lora_add(ptr step, ptr group, ptr x, i64 x_stride, ptr out, i64 out_stride)
        i64 lora_int8()""",
}
CTYPES: dict[str, Any] = {
    "void": None,
    "int": ctypes.c_int,
    "size_t": ctypes.c_size_t,
    "i64": ctypes.c_int64,
    "f32": ctypes.c_float,
    "ptr": ctypes.c_void_p,
}
PROTOTYPE = re.compile(r"(\w+)\s+(\w+)\(([^)]*)\)")


def prototypes(text: str) -> dict[str, tuple[str, list[tuple[str, str]]]]:
    """PROTOTYPES' text: name -> (return type, [(type, argument name)])."""
    return {
        name: (result, [(arg.split()[0], arg.split()[1]) for arg in args.split(",") if arg.strip()])
        for result, name, args in PROTOTYPE.findall(text)
    }


SIGNATURES = {
    name: (CTYPES[result], [CTYPES[kind] for kind, _ in args])
    for text in PROTOTYPES.values()
    for name, (result, args) in prototypes(text).items()
}


def _bind(lib: ctypes.CDLL, name: str) -> Any:
    """`lib`'s function `name` with its restype and argtypes from SIGNATURES."""
    function = getattr(lib, name)
    function.restype, function.argtypes = SIGNATURES[name]
    return function


class Tensor(Protocol):
    """What the wrappers read of a torch.Tensor (no torch here)."""

    @property
    def shape(self) -> Sequence[int]: ...

    def data_ptr(self) -> int: ...

    def stride(self, dim: int) -> int: ...


# queries of one row the attention kernel takes in one pass over its keys (more: in passes)
ATTENTION_QUERIES = 8


@dataclass(frozen=True)
class DecodeAttention:
    """decode_attention.c compiled for one shape; called with tensors (see the C file):
    qkv bf16 [queries..][q_stride] (a query's heads first), pool bf16 [2 kv_heads][slots][dim]
    (keys, then values), tables int64 [rows..][width] (each row's cache blocks), lengths and
    counts int64 [rows..] (row r: counts[r] consecutive queries, the first seeing lengths[r]
    keys, each next one key more), out bf16 [queries..][heads * dim], scratch fp32
    (ATTENTION_QUERIES * group * the longest query's keys); the first `rows` rows attend."""

    kernel: Callable[..., None]  # the C function: addresses, as in PROTOTYPES

    def __call__(
        self,
        qkv: Tensor,
        pool: Tensor,
        tables: Tensor,
        lengths: Tensor,
        counts: Tensor,
        rows: int,
        scale: float,
        out: Tensor,
        scratch: Tensor,
        threads: int,
    ) -> None:
        self.kernel(
            qkv.data_ptr(),
            qkv.stride(0),
            pool.data_ptr(),
            pool.shape[1],
            tables.data_ptr(),
            tables.shape[1],
            lengths.data_ptr(),
            counts.data_ptr(),
            rows,
            pool.shape[0] // 2,
            scale,
            out.data_ptr(),
            scratch.data_ptr(),
            threads,
        )


@functools.lru_cache(maxsize=8)
def decode_attention(
    head_dim: int, group: int, block_size: int, cache_dir: Path | None = None
) -> DecodeAttention:
    """The compiled kernel for these shapes (kept in `cache_dir`, the library cache, where
    given); NativeUnavailable (with the compiler's words) if it cannot be built here."""
    defines = [
        f"-DDIM={head_dim}",
        f"-DGROUP={group}",
        f"-DBLOCK={block_size}",
        f"-DQUERIES={ATTENTION_QUERIES}",
    ]
    lib = _build(defines, variants=THREADED, cache_dir=cache_dir)
    kernel = DecodeAttention(_bind(lib, "decode_attention_bf16"))
    logger.info("native decode attention ready (head_dim %d, group %d)", head_dim, group)
    return kernel


def _build(
    defines: list[str],
    source: Path = SOURCE,
    variants: Sequence[list[str]] = (["-march=native"], []),
    cache_dir: Path | None = None,
) -> ctypes.CDLL:
    """`source` compiled with FLAGS and these -D constants and loaded (predictor.toolchain:
    the first of `variants` that compiles; with a `cache_dir`, kept there for next time).

    Loaded as a PyDLL: calls keep the GIL. A CDLL call releases and retakes it, and a step makes
    ~300 such calls; in the server the event loop's thread takes the GIL at each release and the
    step thread waits up to a switch interval to get it back (served tokens/s fell below torch's
    kernels', though the step alone was faster). These kernels take microseconds; nothing else
    needs the GIL meanwhile."""
    return toolchain.build(
        source, FLAGS, defines, variants, cache_dir, loader=ctypes.PyDLL, headers=[HEADER]
    )


def relevant_flags(flags: frozenset[str] | None = None) -> list[str]:
    """The flags the kernels care about (vector widths, FMA, VNNI, BF16, AMX), for logs."""
    have = cpu_flags() if flags is None else flags
    keep = ("avx", "fma", "f16c", "amx")
    return sorted(f for f in have if f.startswith(keep) or "vnni" in f or "bf16" in f)


def usable_isas(flags: frozenset[str] | None = None) -> list[str]:
    """The instruction sets of ISAS this CPU has, widest first."""
    have = cpu_flags() if flags is None else flags
    return [isa for isa, (needs, _, _) in ISAS.items() if set(needs) <= have]


@dataclass(frozen=True)
class Int4Kernel:
    """The compiled 4-bit matmul for one instruction set (see int4_matmul.c for the layout)."""

    isa: str
    width: int  # output columns per vector
    threaded: bool  # built with OpenMP
    # the C functions (PROTOTYPES); matmul -> 0, or < 0: no memory, or int8 with a group size
    # not a multiple of 32
    repack: Callable[[int, int, int, int, int, int, int], None]
    matmul: Callable[[int, int, int, int, int, int, int, int, int, int], int]
    # at load: GPTQ's int32 words into codes; codes, scales and zeros into bf16 weights
    unpack: Callable[[int, int, int, int | None, int], None]
    dequantize: Callable[[int, int, int, int, int, int, int, int], None]

    @staticmethod
    def packed_bytes(n: int, k: int, group_size: int) -> int:
        return -(-n // 16) * (k // group_size) * (64 + group_size * 8)

    def describe(self) -> str:
        return f"{self.isa}, {self.width} columns a vector" + (", OpenMP" if self.threaded else "")


_INT4: dict[str, Int4Kernel] = {}
_INT4_BUILD = threading.Lock()  # a call while another thread builds waits for its library


def int4_matmul(isa: str, cache_dir: Path | None = None) -> Int4Kernel:
    """int4_matmul.c built for `isa` (once a process: the first call's `cache_dir` serves, see
    _build); NativeUnavailable if this CPU lacks it or no build works."""
    with _INT4_BUILD:
        if isa not in _INT4:
            _INT4[isa] = _int4_matmul(isa, cache_dir)
        return _INT4[isa]


def _matmul_library(isa: str, source: Path, cache_dir: Path | None) -> ctypes.CDLL:
    """A matmul source built for `isa`, OpenMP first (--threads > 1 splits its output tiles);
    NativeUnavailable if this CPU lacks the instruction set or no build works."""
    if isa not in ISAS:
        raise NativeUnavailable(f"unknown instruction set {isa!r} (one of {', '.join(ISAS)})")
    needs, arch, defines = ISAS[isa]
    missing = sorted(set(needs) - cpu_flags())
    if missing:
        raise NativeUnavailable(f"this CPU lacks {', '.join(missing)} for the {isa} kernel")
    return _build(defines, source, [[*arch, "-fopenmp"], arch], cache_dir)


def _int4_matmul(isa: str, cache_dir: Path | None) -> Int4Kernel:
    lib = _matmul_library(isa, INT4_SOURCE, cache_dir)
    threaded = bool(_bind(lib, "int4_threaded")())
    width = int(_bind(lib, "int4_vector_width")())
    return Int4Kernel(
        isa,
        width,
        threaded,
        _bind(lib, "int4_repack"),
        _bind(lib, "int4_matmul"),
        _bind(lib, "gptq_unpack4"),
        _bind(lib, "int4_dequantize"),
    )


@dataclass(frozen=True)
class Int8Kernel:
    """The compiled 8-bit matmul (lm_head) for one instruction set (see int8_matmul.c)."""

    isa: str
    # the C functions (PROTOTYPES): quantize the bf16 weights [n][k] into the layout; matmul
    # (fp32 out) -> 0, < 0: no memory, k % 32; rows (dequantized into bf16 [count][k]) -> 0,
    # -1: an id outside [0, n)
    quantize: Callable[[int, int, int, int], None]
    matmul: Callable[[int, int, int, int, int, int, int, int, int], int]
    rows: Callable[[int, int, int, int, int, int], int]
    nbytes: Callable[[int, int], int]

    def describe(self) -> str:
        return self.isa


_INT8: dict[str, Int8Kernel] = {}
_INT8_BUILD = threading.Lock()


def int8_matmul(isa: str, cache_dir: Path | None = None) -> Int8Kernel:
    """int8_matmul.c built for `isa` (once a process, as int4_matmul); NativeUnavailable if this
    CPU lacks it or no build works."""
    with _INT8_BUILD:
        if isa not in _INT8:
            _INT8[isa] = _int8_matmul(isa, cache_dir)
        return _INT8[isa]


# The matmul libraries the runner takes at start (ModelRunner._tune), for the widest
# instruction set, into library_cache: the int4 projections' and the int8 head's.
MATMULS: dict[str, Callable[[str, Path], Int4Kernel | Int8Kernel]] = {
    "int4": int4_matmul,
    "int8": int8_matmul,
}


def library_cache(autotune_cache: Path) -> Path:
    """Where the compiled libraries (the matmuls, decode attention, layer ops) are kept:
    beside the autotune's choices."""
    return autotune_cache / "native"


def build_in_background(
    cache_dir: Path, attention: tuple[int, int, int] | None = None
) -> list[threading.Thread]:
    """Start building (or loading from `cache_dir`) the MATMULS, and with `attention` (head_dim,
    query heads per KV head, KV block size) the layer ops and decode attention for it, each on
    a thread of its own: the compiler then runs while the checkpoint loads, and the runner's
    own calls find them built or wait for them (toolchain.build's lock). On a first start each
    takes seconds to compile. A build that fails is retried by the runner's call, which reports
    it; one the runner does not call (another family's attention) only costs its compile."""
    isas = usable_isas()
    builds: list[tuple[Callable[..., object], tuple[object, ...]]] = []
    if isas:
        builds += [(build, (isas[0], cache_dir)) for build in MATMULS.values()]
    if attention is not None:
        head_dim, group, block_size = attention
        builds += [
            (layer_ops, (head_dim, cache_dir)),
            (decode_attention, (head_dim, group, block_size, cache_dir)),
        ]
    threads = [
        threading.Thread(
            target=_build_quietly, args=(build, args), name=f"build-{build.__name__}", daemon=True
        )
        for build, args in builds
    ]
    for thread in threads:
        thread.start()
    return threads


def _build_quietly(build: Callable[..., object], args: tuple[object, ...]) -> None:
    with contextlib.suppress(NativeUnavailable):
        build(*args)


def _int8_matmul(isa: str, cache_dir: Path | None) -> Int8Kernel:
    lib = _matmul_library(isa, INT8_SOURCE, cache_dir)
    names = ("int8_quantize", "int8_matmul", "int8_rows", "int8_bytes")
    return Int8Kernel(isa, *(_bind(lib, name) for name in names))


@dataclass(frozen=True)
class LayerOps:
    """layer_ops.c for one head_dim: a layer's norms, rotary + cache write, SwiGLU and LoRA's
    per-row products (the C functions, PROTOTYPES; add_rms_norm's delta may be None: none)."""

    add_rms_norm: Callable[[int, int | None, int, float, int, int, int, int], None]
    rope_write: Callable[[int, int, int, int, int, int, int, int, int, int], None]
    silu_mul: Callable[[int, int, int, int, int], None]
    lora_add: Callable[[int, int, int, int, int, int], None]
    lora_int8: Callable[[], int]


@functools.lru_cache(maxsize=4)
def layer_ops(head_dim: int, cache_dir: Path | None = None) -> LayerOps:
    """layer_ops.c compiled for this head_dim (kept in `cache_dir`, the library cache, where
    given); NativeUnavailable if it cannot be built here."""
    lib = _build([f"-DDIM={head_dim}"], LAYER_SOURCE, THREADED, cache_dir)
    names = ("add_rms_norm", "rope_write", "silu_mul", "lora_add", "lora_int8")
    ops = LayerOps(*(_bind(lib, name) for name in names))
    logger.info("native layer ops ready (head_dim %d)", head_dim)
    return ops
