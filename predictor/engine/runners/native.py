"""The runner's native decode attention (`decode_attention.c`), compiled at first use.

torch has no CPU op that attends from a paged cache: the runner's torch path gathers every
decode row's keys and values into a padded copy (one `index_select` a layer) and multiplies
3-row matrices in batched bf16 matmuls, where each small matrix costs more in dispatch than in
arithmetic. The C kernel reads each row's blocks where they lie. Measured for SmolLM2's shapes
(9 heads, 3 KV heads, head_dim 64), one layer, 1 thread, gather included: 1 row of 150 tokens
9 us against 97 us; 16 rows 125 us against 308; 16 rows of 400 tokens 380 against 896.

It is compiled once per process and model shape with the system C compiler (`$CC`, else the
first of cc, gcc, g++, clang), about 0.3 s, into a temporary file; where no compiler works the
runner keeps its torch path (`--attention torch` forces it). No torch here: the runner passes
tensors' addresses.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

from predictor.errors import NativeUnavailable

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode_attention.c")
FLAGS = ["-O3", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros"]

# q, q_stride, pool, slots, tables, table_width, lengths, rows, kv_heads, scale, out, scratch
DecodeAttention = Callable[[int, int, int, int, int, int, int, int, int, float, int, int], None]


@functools.lru_cache(maxsize=8)
def decode_attention(head_dim: int, group: int, block_size: int) -> DecodeAttention:
    """The compiled kernel for these shapes; NativeUnavailable (with the compiler's words) if
    it cannot be built here."""
    names = [os.environ["CC"]] if os.environ.get("CC") else ["cc", "gcc", "g++", "clang"]
    compiler = next((name for name in names if shutil.which(name)), None)
    if compiler is None:
        raise NativeUnavailable(f"no C compiler (none of {', '.join(names)} found)")
    try:
        lib = _build(compiler, [f"-DDIM={head_dim}", f"-DGROUP={group}", f"-DBLOCK={block_size}"])
    except OSError as error:  # no writable temp folder, a noexec one, ...
        raise NativeUnavailable(f"the kernel could not be built or loaded: {error}") from error
    function = lib.decode_attention_bf16
    pointer, integer = ctypes.c_void_p, ctypes.c_int64
    function.restype = None
    function.argtypes = [pointer, integer, pointer, integer, pointer, integer, pointer]
    function.argtypes += [integer, integer, ctypes.c_float, pointer, pointer]
    logger.info("native decode attention compiled (head_dim %d, group %d)", head_dim, group)
    kernel: DecodeAttention = function
    return kernel


def _build(compiler: str, defines: list[str]) -> ctypes.CDLL:
    """Compile decode_attention.c with these -D constants and load it."""
    with tempfile.TemporaryDirectory(prefix="gptq-predictor-native-") as folder:
        library = Path(folder) / "decode_attention.so"
        errors = []
        # -march=native first (vector width of this CPU); some compilers lack it
        for arch in (["-march=native"], []):
            command = [compiler, *FLAGS, *arch, *defines, "-fPIC", "-shared"]
            command += ["-x", "c", str(SOURCE), "-o", str(library)]  # C, even to g++
            try:
                done = subprocess.run(command, capture_output=True, text=True, timeout=120)
            except (OSError, subprocess.TimeoutExpired) as error:
                raise NativeUnavailable(f"{compiler} failed: {error}") from error
            if done.returncode == 0:
                break
            errors.append(done.stderr.strip()[-500:])
        else:
            raise NativeUnavailable(f"{compiler} failed: {' | '.join(errors)}")
        return ctypes.CDLL(str(library))  # mapped: the file may go with the folder
