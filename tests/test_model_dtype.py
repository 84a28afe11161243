"""What `--dtype auto` runs a model in: float32 on the CPU backend; on an Apple GPU the
checkpoint's own half dtype, read from the manifest of a dir converted here or from the
config.json of any other."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from tiny_models import build_tiny_model

from convert import convert_model
from metal_engine.loading.model_dtype import auto_half_dtype, resolve_dtype


def _dir(tmp_path, config: dict):
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize(("config", "expected"), [
    ({"model_type": "qwen3", "torch_dtype": "bfloat16"}, "bfloat16"),  # transformers 4
    ({"model_type": "llama", "dtype": "float16"}, "float16"),  # transformers 5
    ({"model_type": "llama", "dtype": "float32"}, "float16"),  # as vLLM
    ({"model_type": "gemma3_text", "dtype": "float32"}, "bfloat16"),  # float16 overflows
    ({"model_type": "gemma3", "text_config": {"dtype": "bfloat16"}}, "bfloat16"),
    ({"model_type": "mistral"}, "float16"),
])  # fmt: skip
def test_auto_on_an_apple_gpu_keeps_the_checkpoints_half_dtype(tmp_path, config, expected):
    assert auto_half_dtype(_dir(tmp_path / "m", config)) == expected


def test_a_converted_dir_remembers_the_dtype_its_source_was_saved_in(tmp_path):
    build_tiny_model("qwen3", tmp_path / "hf")
    config_path = tmp_path / "hf" / "config.json"
    config = json.loads(config_path.read_text())
    config["dtype"] = "bfloat16"  # as Qwen publishes it; the tiny weights stay float32
    config_path.write_text(json.dumps(config))
    out = convert_model(tmp_path / "hf", tmp_path / "out", progress=False)
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"  # as written
    assert auto_half_dtype(out) == "bfloat16"


def test_auto_is_float32_on_the_cpu_backend_and_names_win(tmp_path):
    path = _dir(tmp_path / "m", {"model_type": "qwen3", "dtype": "bfloat16"})
    if not mx.metal.is_available():
        assert resolve_dtype("auto", path) == mx.float32
    else:
        assert resolve_dtype("auto", path) == mx.bfloat16
    assert resolve_dtype("float16", path) == mx.float16
