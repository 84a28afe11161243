"""MoE router variants the engine does not implement are refused at the command line, by
`metal-serve convert` and by `metal-serve serve`, with one line naming the config field, so
that no checkpoint is served with the wrong routing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from tiny_models import build_tiny_model

from convert import convert_model
from convert.model_ref import loads_as_is
from server.cli import main

# (model_type, config field, a value selecting a router this engine does not run)
VARIANTS = [
    ("glm4_moe", "scoring_func", "softmax"),
    ("glm4_moe", "topk_method", "greedy"),
    ("qwen3_moe", "scoring_func", "sigmoid"),
]


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """model_type -> (Hugging Face dir, converted model dir)."""
    dirs = {}
    for model_type in {v[0] for v in VARIANTS}:
        root = tmp_path_factory.mktemp(model_type)
        build_tiny_model(model_type, root / "hf")
        dirs[model_type] = (root / "hf", convert_model(root / "hf", root / "out",
                                                       progress=False))
    return dirs


def with_config(folder: Path, dst: Path, field: str, value: str) -> Path:
    shutil.copytree(folder, dst)
    config = json.loads((dst / "config.json").read_text())
    config[field] = value
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _one_line_naming(err: str, field: str, value: str) -> None:
    errors = [line for line in err.splitlines() if ": error: " in line]  # serve logs too
    assert len(errors) == 1 and "Traceback" not in err, err
    assert f"{field}={value!r}" in errors[0] and "is not supported" in errors[0], err


@pytest.mark.parametrize(("model_type", "field", "value"), VARIANTS)
def test_convert_refuses_the_router_variant(moe_dirs, tmp_path, capsys, model_type, field,
                                            value) -> None:
    source = with_config(moe_dirs[model_type][0], tmp_path / "hf", field, value)
    assert main(["convert", str(source), "--out", str(tmp_path / "out"), "--no-progress"]) == 2
    _one_line_naming(capsys.readouterr().err, field, value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("model_type", "field", "value"), VARIANTS)
def test_serve_refuses_the_router_variant(moe_dirs, tmp_path, capsys, model_type, field,
                                          value) -> None:
    model_dir = with_config(moe_dirs[model_type][1], tmp_path / "model", field, value)
    assert main(["serve", str(model_dir), "--port", "0"]) == 2
    _one_line_naming(capsys.readouterr().err, field, value)


def test_hf_layout_moe_repo_is_converted_not_loaded_as_is(moe_dirs) -> None:
    # Its experts are one tensor each; the engine loads them stacked, so the hub snapshot of
    # such a repo goes through conversion.
    hf_dir, _ = moe_dirs["qwen3_moe"]
    assert (hf_dir / "tokenizer.json").is_file()
    assert not loads_as_is(hf_dir)
