"""What `quantize --source` costs at a shape: wall time and peak memory, against the bound.

    python -m load.bench_quantize --shape smollm2-135m [--texts 150] [--threads 2] [--keep DIR]
        [--stop-after-layers N]

A random-weight bf16 Llama source of the shape (load/random_gptq.py's SHAPES, with the default
model's tokenizer) is written a layer a shard, so writing it never holds more than one layer;
then the real command line quantizes it (`python -m predictor.model.quantize --source`, the
whole build: GPTQ, the in-process and the served gates), while the RSS of its process tree is
sampled every 0.2 s. The bound it is held to (issue 69): 1.5x one decoder layer's weights in
fp32, plus the calibration activations (the texts' tokens x hidden size x 4 bytes), plus 2 GB.
Random weights make a meaningless model, so the gates may refuse it (--max-ratio is set out of
reach): the build's time and memory are what is measured, whatever the verdict. Besides
random_gptq's shapes, "llama-3.1-8b" (Llama-3.1-8B's: 32 layers, hidden 4096, MLP 14336, 8 KV
heads, an untied 128,256-token head; ~16 GB in bf16 on disk); `--stop-after-layers N` ends a
build once its GPTQ phase has finished N layers (a shape too slow to build whole in a session:
the phase's peak is reached in its first layer and stays flat after, load/RESULTS.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch
from safetensors.torch import save_file

from load.random_gptq import SHAPES, Shape
from predictor.model.env import cpu_name

REPO = Path(__file__).resolve().parent.parent
# random_gptq's shapes and the 7B-class one issue 69 sizes the build for (a 24 GB machine)
BENCH_SHAPES = {
    **SHAPES,
    "llama-3.1-8b": Shape(4096, 14336, 32, 32, 8, 128, vocab_size=128256, rope_theta=500000.0,
                          max_position_embeddings=131072, tie_word_embeddings=False),
}  # fmt: skip
TOKENIZER = REPO / "models" / "smollm2-135m-instruct-gptq"
SAMPLE_SECONDS = 0.2


def layer_tensors(shape: Shape, index: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    hidden, inner = shape.hidden_size, shape.intermediate_size
    q, kv = shape.num_attention_heads * shape.head_dim, shape.num_key_value_heads * shape.head_dim
    sizes = {"self_attn.q_proj": (q, hidden), "self_attn.k_proj": (kv, hidden),
             "self_attn.v_proj": (kv, hidden), "self_attn.o_proj": (hidden, q),
             "mlp.gate_proj": (inner, hidden), "mlp.up_proj": (inner, hidden),
             "mlp.down_proj": (hidden, inner)}  # fmt: skip
    prefix = f"model.layers.{index}."
    tensors = {
        f"{prefix}{name}.weight": (torch.randn(size, generator=generator) / size[1] ** 0.5).to(
            torch.bfloat16
        )
        for name, size in sizes.items()
    }
    for norm in ("input_layernorm", "post_attention_layernorm"):
        tensors[f"{prefix}{norm}.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    return tensors


def write_source(out: Path, shape: Shape, tokenizer: Path, seed: int = 0) -> Path:
    """A random bf16 Llama checkpoint of `shape`, one shard per layer (and one for the
    embeddings, the final norm and the head), with the tokenizer of `tokenizer`."""
    out.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    shards = shape.num_hidden_layers + 1
    weight_map: dict[str, str] = {}

    def save(tensors: dict[str, torch.Tensor], number: int) -> None:
        name = f"model-{number:05d}-of-{shards:05d}.safetensors"
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))

    vocab, hidden = shape.vocab_size, shape.hidden_size
    outer = {"model.embed_tokens.weight": torch.randn((vocab, hidden), generator=generator)
             .mul_(0.5).to(torch.bfloat16), "model.norm.weight": torch.ones(hidden)
             .to(torch.bfloat16)}  # fmt: skip
    if not shape.tie_word_embeddings:
        outer["lm_head.weight"] = (torch.randn((vocab, hidden), generator=generator) * 0.5).to(
            torch.bfloat16
        )
    save(outer, 1)
    for index in range(shape.num_hidden_layers):
        save(layer_tensors(shape, index, generator), index + 2)
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1)
    )
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": hidden, "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads, "head_dim": shape.head_dim,
        "vocab_size": vocab, "max_position_embeddings": shape.max_position_embeddings,
        "rms_norm_eps": 1e-5, "rope_theta": shape.rope_theta,
        "tie_word_embeddings": shape.tie_word_embeddings, "attention_bias": False,
        "mlp_bias": False, "bos_token_id": 1, "eos_token_id": 2, "dtype": "bfloat16",
    }  # fmt: skip
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer / name).is_file():
            shutil.copy(tokenizer / name, out / name)
    return out


def bound_bytes(shape: Shape, calibration_tokens: int) -> dict[str, float]:
    """The bound's terms, in bytes."""
    hidden, inner = shape.hidden_size, shape.intermediate_size
    q, kv = shape.num_attention_heads * shape.head_dim, shape.num_key_value_heads * shape.head_dim
    layer = 4 * (2 * hidden * q + 2 * hidden * kv + 3 * hidden * inner)
    activations = 4 * calibration_tokens * hidden
    return {"layer_fp32": layer, "activations": activations,
            "bound": 1.5 * layer + activations + 2 * 1024**3}  # fmt: skip


def calibration_tokens(texts: int) -> int:
    from transformers import AutoTokenizer

    from predictor.model.recipe import DEFAULT_RECIPE, source_texts

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    picked = DEFAULT_RECIPE.__class__(texts=texts).pick(source_texts())
    return sum(len(tokenizer(text)["input_ids"]) for text in picked)


PHASES = {"dequantizing": "dequantize", "1/3 GPTQ": "gptq", "2/3 quality": "evaluate",
          "3/3 quality as served": "served"}  # fmt: skip


def run_sampled(
    command: list[str], log: Path, stop_at: str | None = None
) -> tuple[int, float, dict[str, float]]:
    """Run `command`; its exit code, wall seconds and its process tree's peak RSS in bytes in
    each phase the build prints, overall ("all") and of the build's own process alone
    ("builder": the phases' processes are its children). When `stop_at` appears in the log
    the build is stopped there (its tree terminated; the exit code is then -15)."""
    started, phase, peaks = time.monotonic(), "start", {"all": 0.0, "builder": 0.0}
    with log.open("w") as out:
        process = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        root = psutil.Process(process.pid)
        while process.poll() is None:
            with contextlib.suppress(psutil.Error):  # a process that ended meanwhile
                tree = (root, *root.children(recursive=True))
                rss = float(sum(_rss(p) for p in tree))
                text = log.read_text(errors="replace")
                phase = next((name for mark, name in reversed(PHASES.items()) if mark in text),
                             phase)  # fmt: skip
                peaks[phase] = max(peaks.get(phase, 0.0), rss)
                peaks["all"] = max(peaks["all"], rss)
                peaks["builder"] = max(peaks["builder"], float(_rss(root)))
                if stop_at is not None and stop_at in text:
                    for member in reversed(tree):
                        with contextlib.suppress(psutil.Error):
                            member.terminate()
            time.sleep(SAMPLE_SECONDS)
    return process.returncode, time.monotonic() - started, peaks


def _rss(process: psutil.Process) -> int:
    try:
        return int(process.memory_info().rss)
    except psutil.Error:
        return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(BENCH_SHAPES), default="smollm2-135m")
    parser.add_argument("--texts", type=int, default=150, help="calibration texts (0: all)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--keep", type=Path, help="keep the source and the build here")
    parser.add_argument(
        "--stop-after-layers", type=int, help="stop the build once GPTQ has finished N layers"
    )
    args = parser.parse_args()
    shape = BENCH_SHAPES[args.shape]
    stop_at = None
    if args.stop_after_layers:
        stop_at = f"layer {args.stop_after_layers}/{shape.num_hidden_layers}"
    work = args.keep or Path(tempfile.mkdtemp(prefix="bench-quantize-"))
    try:
        source = work / f"{args.shape}-bf16"
        if not (source / "config.json").is_file():
            started = time.monotonic()
            write_source(source, shape, TOKENIZER)
            print(f"[bench-quantize] wrote {source} in {time.monotonic() - started:.0f} s",
                  flush=True)  # fmt: skip
        out = work / f"{args.shape}-gptq"
        command = [sys.executable, "-m", "predictor.model.quantize", "--source", str(source),
                   "--out", str(out), "--texts", str(args.texts), "--threads", str(args.threads),
                   "--group-size", str(args.group_size), "--max-ratio", "1000"]  # fmt: skip
        code, seconds, peaks = run_sampled(command, work / "quantize.log", stop_at)
        peak = peaks["all"]
        terms = bound_bytes(shape, calibration_tokens(args.texts))
        gib = 1024**3
        print(
            f"[bench-quantize] {args.shape} on {cpu_name()}, {args.threads} threads, "
            f"{args.texts or 'all'} texts: exit {code}"
            f"{f' (stopped at {stop_at!r})' if stop_at else ''}, {seconds / 60:.1f} min, peak RSS "
            f"{peak / gib:.2f} GiB against the bound {terms['bound'] / gib:.2f} GiB (one layer "
            f"fp32 {terms['layer_fp32'] / gib:.3f} GiB, activations "
            f"{terms['activations'] / gib:.3f} GiB, + 2): "
            f"{'within' if peak <= terms['bound'] else 'PAST'}; by phase: "
            + ", ".join(
                f"{name} {value / gib:.2f}" for name, value in peaks.items() if name != "all"
            ),
            flush=True,
        )
        if code != 0:
            print((work / "quantize.log").read_text()[-3000:])
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
