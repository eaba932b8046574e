"""Checkpoints of a real model's shape for the side by side at real sizes (`make bench-peers
SHAPE=smollm2-1.7b`): random weights in our GPTQ layout (load/random_gptq.py, group 32
asymmetric, as the default build), and llama.cpp's Q4_0 and Q4_1 GGUFs of the same weights
(our GPTQ dequantized to fp16, `convert_hf_to_gguf.py`, `llama-quantize`, all from the
llama-cpp-python sdist `make llama-cpp` unpacks). Speed depends on the shape, not on the
weights; each file is built once under `models/shapes/SHAPE/`.

    .venv/bin/python -m load.peer_shapes --shape smollm2-1.7b
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from load.random_gptq import SHAPES, Layout, write_checkpoint

ROOT = Path("models/shapes")
TOKENIZER_DIR = Path("models/smollm2-135m-instruct-fp")
LAYOUT = Layout(4, 32, sym=False)
GGUF_TYPES = ("Q4_0", "Q4_1")


@dataclass(frozen=True)
class ShapeModels:
    gptq: Path
    ggufs: dict[str, Path]  # llama-quantize type -> file

    @property
    def name(self) -> str:
        return self.gptq.parent.name


def kv_bytes_per_token(shape: str) -> int:
    """Keys and values of one token in every layer, in 16-bit (both sides' KV cache dtype)."""
    s = SHAPES[shape]
    return 2 * s.num_hidden_layers * s.num_key_value_heads * s.head_dim * 2


def build(shape: str, llama_dir: Path, root: Path = ROOT) -> ShapeModels:
    """Our GPTQ checkpoint of `shape` and llama.cpp's GGUFs of the same weights, built where
    missing (minutes for a 1-2B shape, most of it the fp16 export and the conversion)."""
    folder = root / shape
    gptq = folder / "gptq"
    if not (gptq / "config.json").is_file():
        say(f"writing a random GPTQ checkpoint of {shape}: {gptq}")
        write_checkpoint(gptq, SHAPES[shape], LAYOUT, TOKENIZER_DIR, seed=0)
    ggufs = {kind: folder / f"{kind.lower()}.gguf" for kind in GGUF_TYPES}
    if all(path.is_file() for path in ggufs.values()):
        return ShapeModels(gptq, ggufs)
    f16 = folder / "f16.gguf"
    if not f16.is_file():
        fp16 = folder / "fp16"
        if not (fp16 / "config.json").is_file():
            export_fp16(gptq, fp16)
        say(f"converting {fp16} to {f16}")
        converter = llama_dir / "src" / "convert_hf_to_gguf.py"
        env = {**os.environ, "PYTHONPATH": str(llama_dir / "src" / "gguf-py")}
        run([sys.executable, str(converter), str(fp16), "--outfile", str(f16), "--outtype", "f16"],
            env)  # fmt: skip
    quantize = llama_dir / "build" / "bin" / "llama-quantize"
    for kind, path in ggufs.items():
        if not path.is_file():
            say(f"llama-quantize {f16} {kind}")
            run([str(quantize), str(f16), str(path), kind])
    return ShapeModels(gptq, ggufs)


def export_fp16(gptq: Path, out: Path) -> None:
    """The GPTQ checkpoint's exact weights as a plain fp16 transformers checkpoint."""
    import torch

    from predictor.model.loader import load_checkpoint

    say(f"expanding {gptq} to fp16: {out}")
    loaded = load_checkpoint(gptq, device="cpu", kernel="dequantized", dtype=torch.float16)
    model = loaded.model
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    loaded.tokenizer.save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config, indent=2))


def run(command: list[str], env: dict[str, str] | None = None) -> None:
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{command[0]} failed ({done.returncode}):\n{done.stderr[-3000:]}")


def say(message: str) -> None:
    print(f"[peer-shapes] {message}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(set(SHAPES) - {"tiny"}), required=True)
    parser.add_argument("--llama-dir", type=Path, default=Path(".llama-cpp"))
    args = parser.parse_args()
    models = build(args.shape, args.llama_dir)
    say(f"{models.gptq}; " + "; ".join(f"{k} {p}" for k, p in models.ggufs.items()))


if __name__ == "__main__":
    main()
