"""The reference's figures kept once computed (predictor.model.reference_cache): in its folder,
and for the default model's source, in the package."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from predictor.model import reference_cache
from predictor.model.evaluate import reference_settings
from predictor.model.perplexity import TEST_TEXT, TEXTS, WINDOW, text_ids
from tests.conftest import REPO
from tests.support import worker_cores

SOURCE = REPO / "models" / "smollm2-135m-instruct-fp"  # what `make model` exports (make test)


def key_of(folder: Path, text: Path) -> dict[str, object]:
    return reference_cache.cache_key(folder, {"test": text}, {"window": 512})


def test_a_changed_reference_or_text_is_another_cache_key(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    text = tmp_path / "text.txt"
    text.write_text("one")
    key = key_of(tmp_path, text)
    assert reference_cache.store(tmp_path, key, {"x": 1})
    assert reference_cache.load(tmp_path, key) == ({"x": 1}, tmp_path / "reference.json")
    text.write_text("two")
    assert reference_cache.load(tmp_path, key_of(tmp_path, text)) is None
    (tmp_path / "config.json").write_text('{"changed": true}')
    assert reference_cache.load(tmp_path, key_of(tmp_path, text)) is None
    assert not reference_cache.store(tmp_path / "missing", key, {"x": 1})  # unwritable: no cache


def test_the_key_is_the_files_contents_not_their_times(tmp_path: Path) -> None:
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\0" * 4096)
    text = tmp_path / "text.txt"
    text.write_text("one")
    key = key_of(tmp_path, text)
    os.utime(weights, (1, 1))  # a copy or a new export of the same bytes: the same key
    assert key_of(tmp_path, text) == key
    weights.write_bytes(b"\0" * 4095 + b"\1")  # one byte: another key
    assert key_of(tmp_path, text) != key


def test_shipped_figures_serve_a_folder_of_the_same_key_after_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reference_cache, "SHIPPED", tmp_path / "shipped.json")
    folder = tmp_path / "fp"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    key = key_of(folder, TEST_TEXT)
    assert reference_cache.load(folder, key) is None
    reference_cache.ship(key, {"from": "package"}, "a CPU")
    assert reference_cache.load(folder, key) == ({"from": "package"}, tmp_path / "shipped.json")
    assert reference_cache.shipped()["measured_on"] == "a CPU"
    reference_cache.store(folder, key, {"from": "folder"})  # the folder's own comes first
    assert reference_cache.load(folder, key) == ({"from": "folder"}, folder / "reference.json")
    (folder / "config.json").write_text('{"other": 1}')
    assert reference_cache.load(folder, key_of(folder, TEST_TEXT)) is None


@pytest.mark.skipif(not SOURCE.is_dir(), reason="run `make model` first (make test does)")
def test_the_shipped_figures_are_the_exported_sources_on_this_machine(tmp_path: Path) -> None:
    """The package's figures have the key of the fp folder `make model` exported here, so a
    first build reads them; the source scored again here (the test text's first window and
    the first prompt's next-token choices) gives the same figures."""
    import torch

    from predictor.model.agreement import next_token_choices
    from predictor.model.perplexity import load_candidate, window_losses

    shipped = reference_cache.shipped()
    folder = tmp_path / "fp"
    shutil.copytree(SOURCE, folder, copy_function=os.link)  # linked, without its own cache
    (folder / reference_cache.CACHE_FILE).unlink(missing_ok=True)
    key = reference_cache.cache_key(folder, TEXTS, reference_settings())
    assert shipped["key"] == key, (
        "the shipped figures are not this export's: python -m predictor.model.evaluate "
        f"{SOURCE.relative_to(REPO)} --ship-reference --threads 2"
    )
    cached = reference_cache.load(folder, key)
    assert cached is not None and cached.file == reference_cache.SHIPPED
    figures = cached.figures
    candidate = load_candidate(SOURCE, threads=min(2, worker_cores()))
    ids = text_ids(candidate.tokenizer, TEST_TEXT)[:WINDOW]
    [(loss, count)] = window_losses(candidate.model, ids, WINDOW, lambda _m: None)
    [stored_loss, stored_count] = figures["windows"]["test"][0]
    assert count == stored_count
    assert loss == pytest.approx(stored_loss, rel=1e-4)  # AVX2 against AVX-512: about 1e-5
    first = reference_cache.as_sequences(figures["sequences"])[:1]
    assert next_token_choices(candidate.model, first, lambda _m: None) == figures["choices"][:1]
    assert figures["scored"]["kernel"] == str(torch.float32).removeprefix("torch.")
