"""Code shipped in a model dir is never run, by serving or by conversion.

Each dir here has an `auto_map` naming a class in its own tokenization_evil.py, whose import
writes a marker file. Left to itself, transformers asks "Do you wish to run the custom code?
[y/N]" and imports it on a "y"; every load runs in a subprocess whose stdin answers "y".
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import build_tiny_model

from convert import convert_model

EVIL_CODE = """\
from pathlib import Path
Path({marker!r}).write_text("ran")
from transformers import PreTrainedTokenizerFast
class EvilTokenizer(PreTrainedTokenizerFast):
    pass
"""
AUTO_MAP = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer",
                              "tokenization_evil.EvilTokenizer"]}
REFUSAL = "metal-serve never runs code from a model dir"
# The dir's tokenizer as transformers loads it, and its ids for a probe text.
LOAD = """
import sys
from {module} import {function} as load
tokenizer = load(sys.argv[1])
print(type(tokenizer).__module__, tokenizer("w77").input_ids)
"""
ENGINE = """
import sys
from pathlib import Path
from metal_engine.config import EngineConfig
from metal_engine.engine_build import build_engine
build_engine(EngineConfig(model_dir=Path(sys.argv[1]), kv_cache_memory=2**20))
"""
CONVERT = """
import sys
from convert import convert_model
convert_model(sys.argv[1], sys.argv[2], progress=False)
"""


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory) -> tuple[Path, Path]:
    """(a tiny Llama's Hugging Face dir, its conversion)."""
    root = tmp_path_factory.mktemp("custom-code")
    build_tiny_model("llama", root / "hf")
    return root / "hf", convert_model(root / "hf", root / "out", progress=False)


def with_evil_code(model_dir: Path, dst: Path, tokenizer_config: dict) -> Path:
    """A copy of `model_dir` with `tokenizer_config` and the marker-writing module beside it."""
    shutil.copytree(model_dir, dst)
    (dst / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (dst / "tokenization_evil.py").write_text(EVIL_CODE.format(marker=str(marker(dst))))
    return dst


def marker(model_dir: Path) -> Path:
    return model_dir.parent / f"{model_dir.name}-code-ran"


def answering_yes(script: str, *args: Path) -> subprocess.CompletedProcess:
    """`script` run in a fresh interpreter whose stdin is a pipe that answers "y"."""
    home = args[0].parent / "hf-home"  # where transformers would copy the dir's modules
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-c", script, *map(str, args)], input="y\ny\n",
                          capture_output=True, text=True, env=env, timeout=300)


def test_unguarded_transformers_runs_the_dirs_code(tiny_dirs, tmp_path) -> None:
    """The dirs below are a real hazard: a plain AutoTokenizer load imports the module."""
    evil = with_evil_code(tiny_dirs[1], tmp_path / "evil", {"auto_map": AUTO_MAP})
    run = answering_yes(LOAD.format(module="transformers", function="AutoTokenizer")
                        .replace("load(", "load.from_pretrained("), evil)
    assert "Do you wish to run the custom code?" in run.stdout
    assert marker(evil).exists()


def test_the_engine_refuses_a_tokenizer_that_needs_its_dirs_code(tiny_dirs, tmp_path) -> None:
    evil = with_evil_code(tiny_dirs[1], tmp_path / "evil", {"auto_map": AUTO_MAP})
    run = answering_yes(ENGINE, evil)
    assert run.returncode != 0
    assert "CustomCodeRefused" in run.stderr and REFUSAL in run.stderr
    assert "tokenizer_config.json has an `auto_map`" in run.stderr
    assert "run the custom code" not in run.stdout  # nothing asked
    assert not marker(evil).exists()


def test_an_auto_map_beside_a_standard_tokenizer_is_ignored(tiny_dirs, tmp_path) -> None:
    """A tokenizer_class transformers has loads that class from tokenizer.json, as the dir
    without its auto_map does."""
    evil = with_evil_code(tiny_dirs[1], tmp_path / "evil",
                          {"tokenizer_class": "PreTrainedTokenizerFast", "auto_map": AUTO_MAP})
    load = LOAD.format(module="metal_engine.loading.tokenizer_loading", function="load_tokenizer")
    run = answering_yes(load, evil)
    assert run.returncode == 0, run.stderr
    assert not marker(evil).exists()
    module, ids = run.stdout.strip().split(" ", 1)
    assert module.startswith("transformers.")
    assert ids == "[77]"  # tokenizer.json's id of the word


def test_conversion_refuses_a_source_tokenizer_that_needs_its_code(tiny_dirs, tmp_path) -> None:
    evil = with_evil_code(tiny_dirs[0], tmp_path / "evil", {"auto_map": AUTO_MAP})
    run = answering_yes(CONVERT, evil, tmp_path / "out")
    assert run.returncode != 0
    assert REFUSAL in run.stderr
    assert not marker(evil).exists() and not (tmp_path / "out").exists()


def test_conversion_drops_an_auto_map_the_model_does_not_need(tiny_dirs, tmp_path) -> None:
    """Code files are never copied, so a converted dir keeps no auto_map pointing at them."""
    evil = with_evil_code(tiny_dirs[0], tmp_path / "evil",
                          {"tokenizer_class": "PreTrainedTokenizerFast", "auto_map": AUTO_MAP})
    config = json.loads((evil / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_evil.EvilConfig"}
    (evil / "config.json").write_text(json.dumps(config))
    shutil.copy(evil / "tokenization_evil.py", evil / "configuration_evil.py")
    run = answering_yes(CONVERT, evil, tmp_path / "out")
    assert run.returncode == 0, run.stderr
    assert not marker(evil).exists()
    for name in ("config.json", "tokenizer_config.json"):
        assert "auto_map" not in json.loads((tmp_path / "out" / name).read_text()), name
    assert not list((tmp_path / "out").glob("*.py"))
