"""The GPTQ recipe (gptqmodel's QuantizeConfig fields, the calibration texts a build uses) and
the step that applies it to an fp checkpoint folder: what every build shares, `make model`'s
and a user's `--source` one (predictor/model/quantize.py orchestrates and gates both).
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from predictor.model import heap, internals
from predictor.model.precision import calibration_dtype, keep_unquantized_in
from predictor.model.progress import Progress


@dataclass(frozen=True)
class Recipe:
    """The GPTQ settings (gptqmodel QuantizeConfig fields) of a build."""

    # The group size must divide every layer's input width (SmolLM2-135M: hidden 576, MLP 1536).
    # 32 and asymmetric: the source's own grid (Q4_1 blocks of 32, each with a scale and minimum).
    group_size: int = 32
    sym: bool = False
    desc_act: bool = False
    act_group_aware: bool = True
    static_groups: bool = False
    damp_percent: float = 0.05
    mse: float = 2.0  # search each group's scale and zero point for the least squared error
    # Re-run the calibration forward after each subset (q/k/v, o, gate/up, down) of a layer, so
    # later subsets see the already-quantized earlier ones: 4 forwards per layer instead of 1.
    true_sequential: bool = True
    # Calibration texts per forward batch (not a QuantizeConfig field). gptqmodel sorts the texts
    # by length and leaves padding out of the Hessian; larger batches scored no better, within
    # the noise between runs (load/RESULTS.md).
    batch_size: int = 8
    # How many of calibration.txt's texts a build of the default model uses, evenly spaced over
    # the file (0: all). Half of the 300 scored as well as all of them on both texts, in less of
    # the GPTQ phase's time (load/RESULTS.md, "Quantization recipe"). Not a QuantizeConfig field
    # either; quantize_checkpoint uses the texts it is given.
    texts: int = 150

    def quantize_config(self) -> dict[str, Any]:
        """The gptqmodel QuantizeConfig fields."""
        fields = asdict(self)
        del fields["batch_size"], fields["texts"]
        return fields

    def pick(self, texts: Sequence[str]) -> list[str]:
        """The texts of `texts` this recipe calibrates on: `self.texts` of them, evenly spaced."""
        count = min(self.texts or len(texts), len(texts))
        return [texts[i * len(texts) // count] for i in range(count)]

    def describe(self) -> str:
        kind = "symmetric" if self.sym else "asymmetric"
        flags = ("desc_act", "static_groups", "act_group_aware", "true_sequential")
        extras = "".join(f", {name}" for name in flags if getattr(self, name))
        search = f", mse {self.mse:g}" if self.mse else ""
        return f"group size {self.group_size}, {kind}{extras}{search}, batches of {self.batch_size}"


# Chosen by measurement on the validation text: load/RESULTS.md, "Quantization recipe".
RECIPES = {
    "default": Recipe(),
    "all-texts": Recipe(texts=0),  # every text: 2x the forwards, no better (RESULTS)
    "one-pass": Recipe(true_sequential=False),
}
DEFAULT_RECIPE = RECIPES["default"]
GROUP_SIZE = DEFAULT_RECIPE.group_size


def calibration_texts(name: str = "calibration.txt") -> list[str]:
    """The project's calibration texts, one per line of `name` (beside this module)."""
    path = Path(__file__).with_name(name)
    return [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def source_texts() -> list[str]:
    """What a `--source` build calibrates on: the default build's texts (dialogue, prose, code,
    how-tos) and calibration_extra.txt's domains (tables, lists, legal and technical text),
    interleaved so a recipe's evenly spaced pick keeps every domain."""
    base = calibration_texts()
    extra = [t.replace("\\n", "\n") for t in calibration_texts("calibration_extra.txt")]  # tables
    step = max(1, len(base) // max(1, len(extra)))
    texts: list[str] = []
    for index, text in enumerate(base):
        texts.append(text)
        if index % step == step - 1 and extra:
            texts.append(extra.pop(0))
    return texts + extra


def quantize_checkpoint(
    source: Path,
    out: Path,
    texts: Sequence[str],
    group_size: int | None = None,
    recipe: Recipe = DEFAULT_RECIPE,
    progress: Progress | None = None,
    dtype: str = "auto",
    bits: int = 4,
    checkpoint_format: str = "gptq",
) -> list[dict[str, Any]]:
    """GPTQ-quantize an fp checkpoint folder to `bits`; writes the checkpoint and tokenizer.
    Returns each quantized module's GPTQ loss (`module_losses`), the worst first.

    `group_size` overrides the recipe's (the tiny test model keeps its own). With `progress`,
    each finished layer is a step of its current phase. `dtype` is that of the calibration
    forwards ("auto": the faster here, predictor.model.precision); the checkpoint stores its
    unquantized weights in bf16 either way. `checkpoint_format`: gptq (AutoGPTQ's layout, zero
    points stored minus one) or gptq_v2 (gptqmodel's, as they are); vLLM, transformers and our
    loader read both.
    """
    import torch
    from gptqmodel import GPTQModel, QuantizeConfig

    from predictor.model.block_update import fused_block_update
    from predictor.model.capture import lean_capture
    from predictor.model.scale_search import vectorised_scale_search

    dtype, _ = calibration_dtype(source, dtype)
    if group_size is not None:
        recipe = replace(recipe, group_size=group_size)
    config = QuantizeConfig(bits=bits, format=checkpoint_format, **recipe.quantize_config())
    model = GPTQModel.load(str(source), config, dtype=getattr(torch, dtype))
    if progress is not None:
        progress.phase("layer", int(model.model.config.num_hidden_layers))
    with vectorised_scale_search(), lean_capture() as products, fused_block_update():
        # its subset_event(stage=..., layer_idx=...): progress, and a finished layer's products
        # and modules let go (kept, they grew the phase's memory with every layer)
        internals.set_subset_callback(model, LayerEvents(progress, lambda: _release(products)))
        log = model.quantize(list(texts), batch_size=recipe.batch_size)
    model.save(str(out))
    keep_unquantized_in(out)
    for extra in ("chat_template.jinja", "tokenizer.json", "tokenizer_config.json"):
        if (source / extra).is_file() and not (out / extra).is_file():
            shutil.copy(source / extra, out / extra)
    return module_losses(log)


def _release(products: Any) -> None:
    """A layer is done: its products and modules go, and the heap's free pages back to the
    system (kept, the phase's RSS grew by a layer's worth each layer)."""
    if products is not None:  # None: gptqmodel's own forwards (a test's comparison)
        products.clear()
    heap.release()


class LayerEvents:
    """gptqmodel's subset events (internals item 2): passed on to `progress`, and
    `on_new_layer()` called when the first event of another layer comes."""

    def __init__(self, progress: Progress | None, on_new_layer: Callable[[], None]) -> None:
        self.progress = progress
        self.on_new_layer = on_new_layer
        self.layer: int | None = None

    def subset_event(
        self,
        *,
        stage: str,
        layer_idx: int,
        subset_index: int,
        subset_total: int,
        module_names: list[str],
        **_: object,
    ) -> None:
        if self.layer is not None and layer_idx != self.layer:
            self.on_new_layer()
        self.layer = layer_idx
        if self.progress is not None:  # the plain fields only: a relay pickles them
            self.progress.subset_event(
                stage=str(stage),
                layer_idx=int(layer_idx),
                subset_index=int(subset_index),
                subset_total=int(subset_total),
                module_names=[str(n) for n in module_names],
            )


def module_losses(log: Any) -> list[dict[str, Any]]:
    """gptqmodel's quantize log ({processor: [{"layer", "module", "loss", ...}]}) as
    [{"layer": int, "module": str, "loss": float}], the largest loss first: where the build
    lost the most (a rejected build's report names them)."""
    losses = []
    for entries in (log or {}).values():
        for entry in entries if isinstance(entries, list) else ():
            with contextlib.suppress(KeyError, TypeError, ValueError):
                losses.append(
                    {
                        "layer": int(entry["layer"]),
                        "module": str(entry["module"]),
                        "loss": float(entry["loss"]),
                    }
                )
    return sorted(losses, key=lambda entry: -entry["loss"])
