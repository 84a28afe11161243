"""Total and active (per token) parameters, counted from the config, against counts of the tiny
checkpoints' real tensors; and where the server reports them: the startup log and /v1/models."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from safetensors.numpy import load_file
from tiny_models import build_tiny_model

import server.http.shutdown
from convert import convert_model
from metal_engine.loading.model_config import ModelConfig
from metal_engine.loading.parameter_count import ParameterCount, count_parameters
from server.cli import main

# One expert's tensor, or all experts' in one (GPT-OSS); not GLM's shared_experts.
EXPERTS = re.compile(r"\.experts\.")


def counted_from_tensors(hf_dir: Path) -> ParameterCount:
    """Every stored tensor counts; an expert's count for the share of tokens that choose it."""
    config = json.loads((hf_dir / "config.json").read_text())
    moe = ModelConfig.from_dict(config).moe
    total = active = 0
    for name, tensor in load_file(hf_dir / "model.safetensors").items():
        if name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue  # the embedding again
        total += tensor.size
        if EXPERTS.search(name):
            active += tensor.size * moe.experts_per_token // moe.num_experts
        else:
            active += tensor.size
    return ParameterCount(total, active)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "glm4_moe", "gpt_oss", "llama",
                                        "deepseek_v3", "mistral4", "minimax_m2"])
def test_counts_equal_the_checkpoints_tensors(model_type: str, tmp_path: Path) -> None:
    build_tiny_model(model_type, tmp_path)
    config = ModelConfig.from_dict(json.loads((tmp_path / "config.json").read_text()))
    counted = count_parameters(config)
    assert counted == counted_from_tensors(tmp_path)
    if config.moe is None:
        assert counted.active == counted.total
    else:
        assert counted.active < counted.total


def test_descriptions() -> None:
    assert ParameterCount(30_532_122_624, 3_348_914_176).describe() == (
        "30.53B parameters, 3.35B active per token")
    assert ParameterCount(134_515_008, 134_515_008).describe() == "134.52M parameters"


def test_serve_logs_and_lists_total_and_active(tmp_path: Path, monkeypatch, capsys) -> None:
    build_tiny_model("qwen3_moe", tmp_path / "hf")
    model_dir = convert_model(tmp_path / "hf", tmp_path / "model", progress=False)
    served = {}
    monkeypatch.setattr(server.http.shutdown, "run_server",
                        lambda app, *args: served.setdefault("app", app))

    assert main(["serve", str(model_dir), "--kv-cache-memory", "16MiB"]) == 0

    expected = counted_from_tensors(tmp_path / "hf")
    assert f"({expected.describe()})" in capsys.readouterr().err
    client = TestClient(served["app"], base_url="http://127.0.0.1:8000")  # the Host check
    cards = client.get("/v1/models").json()["data"]
    assert [(c["num_parameters"], c["active_parameters"]) for c in cards] == [
        (expected.total, expected.active)] * len(cards)


def test_convert_summary_gives_total_and_active(tmp_path: Path, capsys) -> None:
    build_tiny_model("mixtral", tmp_path / "hf")
    argv = ["convert", str(tmp_path / "hf"), "--out", str(tmp_path / "out"), "--no-progress",
            "--no-validate"]
    assert main(argv) == 0
    summary = counted_from_tensors(tmp_path / "hf").describe()
    assert "active per token" in summary and summary in capsys.readouterr().out
