"""The model's matmuls as the CPU runner runs them, prepared at start: each layer's int4
projections fused (q/k/v and gate/up: 4 kernel calls a layer instead of 7) or, where they cannot
be, prepacked for oneDNN; each matmul's kernel chosen (`Matmuls.choose`, the one entry point);
what the choice deferred completed on a thread of its own; and what serving no longer reads let
go (memory.py). The runner only calls the kernels this leaves in `fused` and `head`."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from predictor.config import FUSED_KERNELS
from predictor.engine.runners import memory
from predictor.engine.runners.kernels import autotune
from predictor.engine.runners.kernels.dense_linear import prepack_layer
from predictor.engine.runners.kernels.head_linear import Int8Head
from predictor.engine.runners.kernels.int4_codes import release_repack_tables
from predictor.engine.runners.kernels.int4_linear import FusedLayer, Kernel, fuse_layer, projections
from predictor.engine.runners.kernels.layout_store import LayoutStore
from predictor.engine.runners.native.bindings import MATMULS, library_cache, usable_isas
from predictor.errors import NativeUnavailable

logger = logging.getLogger(__name__)


class Matmuls:
    def __init__(
        self,
        layers: list[Any],
        lm_head: Any,
        forced: str = "auto",
        invariant: bool = True,
        cache_dir: Path | None = None,
        copies_after_ready: bool = False,
        release_model_weights: bool = False,
        copy_budget: int | None = None,
        embedding: Any = None,
    ) -> None:
        """Fuse or prepack every layer now; `forced` (--kernel: auto or one of
        config.FUSED_KERNELS) is checked here, on the loading thread, so a kernel that cannot
        run on this machine is refused before the server starts (ValueError). The other
        arguments are the runner's (cpu.py: `batch_invariant`, `autotune_cache`,
        `copies_after_ready`, `release_model_weights`, `copy_budget`). `embedding`: the
        model's input embedding, which `embed` looks up (from the head's int8 table where a
        tied head serves from it and the model's own weights are let go)."""
        self._layers, self._lm_head = layers, lm_head
        self._embedding = embedding
        self.embed: Kernel = embedding  # ids [N] -> hidden [N, width]
        fused = [fuse_layer(layer) for layer in layers]
        self.fused = [f if isinstance(f, FusedLayer) else None for f in fused]
        reasons = sorted({f for f in fused if isinstance(f, str)})
        # the layers it could not fuse: plain bf16 projections (dequantized) prepacked for oneDNN
        prepacked = sum(
            prepack_layer(layer) for layer, f in zip(layers, self.fused, strict=True) if f is None
        )
        if prepacked:
            logger.info("%d dense bf16 projections prepacked for oneDNN", prepacked)
        if reasons:  # logged once, with why: the model's own modules are the slower path
            logger.log(
                logging.INFO if prepacked else logging.WARNING,
                "%d of %d layers not fused into the native int4 kernels (%s): %s",
                len([f for f in self.fused if f is None]),
                len(self.fused),
                "; ".join(reasons),
                "their dense projections serve them"
                if prepacked
                else "the model's own modules serve them, more slowly",
            )
        if forced != "auto" and forced not in FUSED_KERNELS:
            raise ValueError(f"kernel must be auto or one of {', '.join(FUSED_KERNELS)}")
        if forced != "auto":
            first = next((f for f in self.fused if f is not None), None)
            if first is None:
                raise ValueError(f"kernel {forced} needs fused int4 layers (a CPU GPTQ model)")
            try:  # here, not on the step thread: a kernel that cannot run here is refused now
                first.qkv.kernel(forced)
            except NativeUnavailable as error:
                raise ValueError(f"kernel {forced} is unavailable: {error}") from error
        self.forced, self.invariant = forced, invariant
        self._cache_dir = cache_dir
        self._copies_after_ready = copies_after_ready
        self._release_model_weights = release_model_weights
        self._copy_budget = copy_budget
        self._completing: threading.Thread | None = None
        self.head: Kernel | None = None  # lm_head's dispatcher, once chosen
        self.choices: autotune.Choices | None = None
        # seconds of a step's matmuls by (fed tokens, logit rows), from the autotune's figures
        self._cost: Callable[[int, int], float] | None = None

    def library_cache(self) -> Path | None:
        """Where the native libraries are kept between starts: beside the autotune's choices."""
        return None if self._cache_dir is None else library_cache(self._cache_dir)

    def choose(self, then: Callable[[], None] | None = None) -> None:
        """Choose the kernel of every matmul, once, on the calling thread with its thread count
        (the step thread's: `ModelRunner.bind_thread`). A fused projection's kernel is chosen
        in this order:

        1. the forced flag (--kernel, not auto): that kernel at every row count, checked in
           `__init__`; only lm_head is measured;
        2. the cached plan (autotune_cache.py), where this CPU, its flags, torch, the threads,
           the shapes, the candidates and the C sources are those it was measured with;
        3. else measured per bucket of rows (autotune.py: each candidate timed on the model's
           own weights at each bucket's first row count, the fastest keeps the bucket, a copy
           of the weights only where it wins by COPY_MARGIN);
        4. the invariance filter (--batch-invariant, the default): only the kernels whose rows
           come out the same whatever rows share the call, one for every row count; a kernel
           called a row at a time where none is;
        5. the copies' budget (--max-weight-copies-gb, copies.py): past it, the copies that
           buy the least time per byte give way to the best kernels without one;
        6. the deferred copies (--kernel-copies-after-ready, and not invariant): the buckets
           whose kernels hold a copy of the weights start on the kernel below them and are
           completed on a thread of their own once this returns.

        lm_head the same, among its own candidates (head_linear.py). `then`: run after the
        choice and before the deferred copies start (the runner's LoRA tune, timed on a quiet
        machine)."""
        if self.head is not None:
            return
        fused = [(f, kind) for f in self.fused if f is not None for kind in FusedLayer.KINDS]
        linears = [getattr(f, kind) for f, kind in fused]
        kinds = [kind for _, kind in fused]
        threads = torch.get_num_threads()
        self._build_libraries(bool(linears))
        started = time.perf_counter()
        layouts = None if self._cache_dir is None else LayoutStore(self._cache_dir)
        for linear in linears:
            linear.layouts = layouts
        self.choices, self.head, deferred = autotune.tune(
            linears,
            kinds,
            self._lm_head,
            threads,
            self._cache_dir,
            self.forced,
            self.invariant,
            self._copies_after_ready,
            layouts,
            self._copy_budget,
            self._release_model_weights and self._head_table_goes(),
        )
        if layouts is not None:
            read, written = layouts.read_bytes / 1e9, layouts.written_bytes / 1e9
            logger.info(
                "kernel layouts: %.2f GB mapped from %s, %.2f GB written",
                read,
                layouts.folder,
                written,
            )
        autotune.log_choices(self.choices, threads)
        if then is not None:
            then()
        self._cost = autotune.step_cost(self.choices, linears, kinds, self._lm_head)
        later = f"; {len(deferred)} matmuls' copies built after ready" if deferred else ""
        logger.info(
            "kernels: %.1f s (choices: %s)%s",
            time.perf_counter() - started,
            self.choices.source.split(" ")[0],
            later,
        )
        if not deferred:
            self._release()
            return
        self._completing = threading.Thread(
            target=self._complete, args=(deferred,), name="kernel-copies", daemon=True
        )
        self._completing.start()

    def _build_libraries(self, int4: bool) -> None:
        """The native matmuls built into the cache folder, or loaded from it (the head's int8
        kernel too: it was compiled afresh at every start, about a second before the server
        was ready)."""
        isas, cache = usable_isas(), self.library_cache()
        if not isas or cache is None:
            return
        for name, build in MATMULS.items():
            if name == "int4" and not int4:
                continue  # no int4 projections to serve
            try:
                library = build(isas[0], cache)
            except NativeUnavailable as error:
                logger.warning("native %s matmul unavailable: %s", name, error)
            else:  # logged here: the build may have run before logging was set up
                logger.info("native %s matmul ready (%s)", name, library.describe())

    def cost(self, fed: int, logit_rows: int) -> float | None:
        """What the autotune measured a step of `fed` tokens (`logit_rows` rows of logits)
        costs on this machine, in seconds (None: not measured, e.g. a forced kernel)."""
        return None if self._cost is None else self._cost(fed, logit_rows)

    def join(self) -> None:
        """Wait for the deferred copies (they read the weights: before those are emptied)."""
        if self._completing is not None:
            self._completing.join()

    def _complete(self, deferred: list[autotune.Deferred]) -> None:
        """What the autotune deferred, on a thread of its own while the step thread serves:
        one thread (the step thread keeps the others), the layers switched one by one."""
        started = time.perf_counter()
        torch.set_num_threads(1)
        try:
            head = autotune.complete(deferred)
        except Exception:  # e.g. out of memory: the layers keep serving on their lean plans
            logger.exception("kernels: the deferred copies could not be built; serving without")
            return
        if head is not None:
            self.head = head  # the step thread reads it at its next step
        logger.info(
            "kernels: %d matmuls' copies built in %.1f s: every plan complete",
            len(deferred),
            time.perf_counter() - started,
        )
        self._release()

    def _tied(self) -> bool:
        """lm_head's weight is the input embedding's table."""
        weight = getattr(self._lm_head, "weight", None)
        table = getattr(self._embedding, "weight", None)
        return weight is not None and table is not None and table.data_ptr() == weight.data_ptr()

    def _head_table_goes(self) -> bool:
        """lm_head's bf16 weight can be let go once it serves from its int8 table: untied, or
        tied to a plain `nn.Embedding` (which then reads its rows from that table)."""
        if getattr(self._lm_head, "weight", None) is None:
            return False
        return not self._tied() or type(self._embedding) is torch.nn.Embedding

    def _serve_head_from_int8(self) -> None:
        """Where lm_head serves every row count from its int8 copy, its bf16 weight is no
        longer read: let go, and where it is the input embedding's too (a tied head, a plain
        `nn.Embedding`), the embedding looks its rows up in the int8 table instead (a Q8_0
        rounding of each row, as llama.cpp's quantized token embeddings)."""
        head = self.head
        if not isinstance(head, Int8Head) or not self._head_table_goes():
            return  # e.g. tied to Gemma's scaled embedding: kept as it is
        tied, weight = self._tied(), self._lm_head.weight
        freed = weight.numel() * weight.element_size()
        memory.empty_tensors(self._lm_head)
        if tied:
            self.embed = head.rows
            memory.empty_tensors(self._embedding)
        logger.info(
            "memory: lm_head%s served from its int8 table, %.0f MiB of bf16 weights let go",
            " and the tied embedding" if tied else "",
            freed / 2**20,
        )

    def _release(self) -> None:
        """Let go of what serving no longer reads: the tables and scratch the kernels were built
        with, the model's own 4-bit tensors, the mapped checkpoint's pages."""
        release_repack_tables()
        if self._release_model_weights and all(f is not None for f in self.fused):
            for layer in self._layers:
                qkv, o, gate_up, down = projections(layer)
                for module in (*qkv, o, *gate_up, down):
                    memory.empty_tensors(module)
            self._serve_head_from_int8()
        advised = memory.release_mapped_weights()
        memory.trim_heap()
        logger.info("memory: %.0f MiB of mapped weights released, heap trimmed", advised / 2**20)
