"""make model's pieces that need no model: recipes, the gate on the test text, imports, env."""

from __future__ import annotations

import ast
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

import predictor.model
from predictor.model import quantize
from predictor.model.env import cpu_name, prepare_environment
from predictor.model.evaluate import QualityReport, Scored
from predictor.model.quantize import check_quality
from predictor.model.recipe import DEFAULT_RECIPE, RECIPES, Recipe, calibration_texts


def _report(test_ratio: float, validation_ratio: float) -> QualityReport:
    reference = Scored("fp", "fp", "float32", 30.0, 30.0, 3584, 1.0)
    checkpoint = Scored(
        "gptq", "gptq", "Linear", 30.0 * test_ratio, 30.0 * validation_ratio, 3584, 1.0
    )
    return QualityReport(checkpoint, reference, test_ratio, validation_ratio, 0.8, 8, 10, 1, 512)


def test_the_gate_reads_the_test_text_not_the_validation_text() -> None:
    check_quality(_report(test_ratio=1.05, validation_ratio=1.5), max_ratio=1.10)
    with pytest.raises(SystemExit, match=r"ratio 1\.200 on the test text"):
        check_quality(_report(test_ratio=1.2, validation_ratio=1.0), max_ratio=1.10)


def test_every_recipe_is_a_gptqmodel_config() -> None:
    from gptqmodel import QuantizeConfig

    assert RECIPES["default"] is DEFAULT_RECIPE
    for recipe in RECIPES.values():
        fields = recipe.quantize_config()
        assert "batch_size" not in fields  # a quantize() argument, not a config field
        assert "texts" not in fields  # which texts build_default_model passes
        config = QuantizeConfig(bits=4, **fields)
        assert config.group_size == recipe.group_size and config.mse == recipe.mse
        assert f"batches of {recipe.batch_size}" in recipe.describe()


def test_a_recipe_picks_its_calibration_texts_evenly_spaced() -> None:
    every = calibration_texts()
    assert len(every) == 300
    assert DEFAULT_RECIPE.pick(every) == every[::2]  # the half chosen on the validation text
    assert RECIPES["all-texts"].pick(every) == every
    assert Recipe(texts=100).pick(every) == every[::3]
    assert Recipe(texts=7).pick(list("abc")) == list("abc")  # never more than there are


def test_recipe_is_chosen_on_the_command_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    chosen: list[Any] = []
    monkeypatch.setattr(
        quantize, "build_default_model", lambda *args, **kwargs: chosen.append(args[4])
    )
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    name = next(name for name in RECIPES if name != "default")
    assert quantize.main(["--out", str(tmp_path / "m"), "--recipe", name]) == 0
    assert quantize.main(["--out", str(tmp_path / "m")]) == 0
    assert chosen == [RECIPES[name], DEFAULT_RECIPE]
    with pytest.raises(SystemExit):
        quantize.main(["--recipe", "no-such-recipe"])


def _built(folder: Path, recipe: Recipe) -> None:
    """The files is_built and is_fp_built look for, the GPTQ ones with `recipe` in quality.json."""
    folder.mkdir(parents=True)
    for name in ("config.json", "quantize_config.json", "tokenizer.json", "model.safetensors"):
        (folder / name).write_text("{}")
    build = {"build": {"recipe": asdict(recipe)}}
    (folder / quantize.QUALITY_FILE).write_text(json.dumps(build))


def test_a_build_is_done_again_only_for_another_recipe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out, fp_out = tmp_path / "gptq", tmp_path / "fp"
    _built(out, DEFAULT_RECIPE)
    _built(fp_out, DEFAULT_RECIPE)

    class Building(Exception):
        pass

    def texts() -> list[str]:  # the first thing a build does after the fp checkpoint
        raise Building

    monkeypatch.setattr(quantize, "calibration_texts", texts)
    quantize.build_default_model(out, fp_out, threads=1)
    assert "already built; nothing to do" in capsys.readouterr().out
    other = RECIPES["all-texts"]
    with pytest.raises(Building):
        quantize.build_default_model(out, fp_out, threads=1, recipe=other)
    assert "was not built with the recipe asked for" in capsys.readouterr().out
    assert quantize.is_built(out)  # the old checkpoint stays until a new one passes the gate
    (out / quantize.QUALITY_FILE).write_text("not json")
    assert quantize.built_recipe(out) is None
    with pytest.raises(Building):
        quantize.build_default_model(out, fp_out, threads=1)


def test_cpu_is_named_with_the_isa_torch_is_held_to(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    name = cpu_name()
    assert name and "held" not in name
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    if " avx512f" not in flags:
        return
    assert name.endswith(", AVX-512")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert cpu_name() == f"{name} (torch held to AVX2)"


def test_environment_defaults_two_gptqmodel_workers_and_no_extension_build() -> None:
    env = {"HF_HOME": "/mine"}
    prepare_environment(env, Path("/cache"))
    assert env == {
        "HF_HOME": "/mine",  # what the user set stays
        "HF_HUB_OFFLINE": "1",
        "GPTQMODEL_CPU_WORKERS": "2",
        "TOKENIZERS_PARALLELISM": "false",
        "GPTQMODEL_DISABLE_PACK_EXT": "1",  # no C++ build at a machine's first quantize
    }


def test_model_modules_import_each_other_without_a_circle() -> None:
    folder = Path(predictor.model.__file__).parent
    graph: dict[str, set[str]] = {}
    for path in folder.glob("*.py"):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                if node.module == "predictor.model":
                    names.update(alias.name for alias in node.names)
                elif node.module.startswith("predictor.model."):
                    names.add(node.module.rsplit(".", 1)[1])
        graph[path.stem] = names
    assert "quantize" not in graph["evaluate"] and "env" in graph["evaluate"]

    def reaches(start: str, target: str, seen: set[str]) -> bool:
        for name in graph.get(start, set()):
            if name == target or (name not in seen and reaches(name, target, seen | {name})):
                return True
        return False

    assert [name for name in graph if reaches(name, name, set())] == []
