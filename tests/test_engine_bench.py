"""`bench step` and `bench throughput` run end to end and report what they measured."""

from __future__ import annotations

import argparse
import json

import pytest
from tiny_models import build_tiny_model

from convert import convert_model
from kernels_metal.cpu.ops import HostOps
from server.bench import engine_bench


def parse(add, argv):
    parser = argparse.ArgumentParser()
    add(parser)
    return parser.parse_args(argv)


def test_bench_step_reports_each_batch_size(default_model_dir, tmp_path):
    out = tmp_path / "step.json"
    args = parse(engine_bench.add_step_arguments, [
        str(default_model_dir), "--batch-sizes", "1,8", "--steps", "5", "--context-len", "40",
        "--result-json", str(out),
    ])
    assert engine_bench.run_step(args) == 0
    result = json.loads(out.read_text())["host_overhead_per_decode_step"]
    assert set(result) == {"1", "8"}
    assert all(0 < r["median_ms"] <= r["p90_ms"] for r in result.values())


def test_bench_throughput_counts_every_output_token(default_model_dir, tmp_path):
    out = tmp_path / "throughput.json"
    args = parse(engine_bench.add_throughput_arguments, [
        str(default_model_dir), "--num-prompts", "3", "--input-len", "8", "--output-len", "5",
        "--kv-cache-memory", str(64 << 20), "--result-json", str(out),
    ])
    assert engine_bench.run_throughput(args) == 0
    result = json.loads(out.read_text())
    assert result["num_prompts"] == 3
    elapsed = result["elapsed_s"]
    assert abs(result["output_tokens_per_s"] * elapsed - 15) < 1e-6


@pytest.mark.parametrize("dispatch", ["gather", "grouped"])
def test_bench_throughput_runs_a_moe_model_s_experts_the_way_asked(dispatch, default_tokenizer,
                                                                    tmp_path, monkeypatch):
    build_tiny_model("qwen3_moe", tmp_path / "hf")
    model_dir = convert_model(tmp_path / "hf", tmp_path / "model", progress=False)
    default_tokenizer.save_pretrained(model_dir)
    grouped_calls = []
    original = HostOps.grouped_experts  # the CPU backend's grouped dispatch
    monkeypatch.setattr(HostOps, "grouped_experts",
                        lambda self, *a: grouped_calls.append(1) or original(self, *a))
    out = tmp_path / "throughput.json"
    args = parse(engine_bench.add_throughput_arguments, [
        str(model_dir), "--num-prompts", "2", "--input-len", "8", "--output-len", "3",
        "--kv-cache-memory", str(16 << 20), "--moe-dispatch", dispatch,
        "--result-json", str(out),
    ])
    assert engine_bench.run_throughput(args) == 0
    assert json.loads(out.read_text())["moe_dispatch"] == dispatch
    assert bool(grouped_calls) == (dispatch == "grouped")
