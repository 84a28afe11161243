"""Tensor parallelism on one host, ranks over MLX's ring backend on loopback: the weight split
adds up to the whole layer, two ranks give the tokens one gives (dense, MoE and hybrid
models), and the server with two ranks drains both on SIGTERM and exits non-zero, failing its
requests, when a rank dies."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import mlx.core as mx
import mlx.nn as nn
import pytest
from parallel_run import greedy_tokens, greedy_tokens_in_a_process
from tiny_models import build_tiny_model

from metal_engine.config import EngineConfig
from metal_engine.loading.model_config import ModelConfig
from metal_engine.models.registry import model_class
from metal_engine.parallel.shard import (
    RankShare,
    rank_config,
    shard_model,
    share,
    take_columns,
    take_rows,
)
from server.bench.server_process import free_port, log_tail, wait_ready


def test_shares_cover_every_head_once_earlier_ranks_taking_the_rest():
    assert [list(share(3, r, 2)) for r in range(2)] == [[0, 1], [2]]
    assert [len(share(10, r, 4)) for r in range(4)] == [3, 3, 2, 2]
    with pytest.raises(ValueError, match="1 heads cannot be split over 2 ranks"):
        share(1, 0, 2)


def test_a_rank_config_holds_its_heads(default_model_dir):
    cfg = ModelConfig.from_model_dir(default_model_dir)  # 9 query heads over 3 KV heads
    shares = [rank_config(cfg, RankShare(r, 2, lambda x: x)) for r in range(2)]
    assert [(c.num_attention_heads, c.num_key_value_heads) for c in shares] == [(6, 2), (3, 1)]


@pytest.mark.parametrize("bits", [None, 4])
def test_split_linear_layers_add_up_to_the_whole(bits):
    """Rows split by output, columns by input: the column parts' outputs sum to the layer's,
    quantized layers included (their packing and groups cut at the share's edges)."""
    def layer() -> nn.Module:  # the same weights at each call
        mx.random.seed(0)
        linear = nn.Linear(128, 64, bias=True)
        return nn.QuantizedLinear.from_linear(linear, 32, bits) if bits else linear

    x = mx.random.normal((3, 128))
    expected = layer()(x)
    parts = [take_columns(layer(), start, stop, rank)(x[:, start:stop])
             for rank, (start, stop) in enumerate([(0, 64), (64, 128)])]
    assert mx.allclose(parts[0] + parts[1], expected, atol=1e-4).item()
    rows = take_rows(layer(), [(0, 8), (40, 48)])(x)
    assert mx.allclose(rows, mx.concatenate([expected[:, :8], expected[:, 40:48]], 1),
                       atol=1e-5).item()
    if bits:
        with pytest.raises(ValueError, match="cuts through the quantization groups of 32"):
            take_columns(layer(), 0, 48, 0)


def test_dry_run_prints_what_the_ranks_send_per_step(default_model_dir, capsys):
    from server.cli import main

    assert main(["serve", str(default_model_dir), "--dry-run",
                 "--tensor-parallel-size", "2"]) == 0
    out = capsys.readouterr().out
    # 30 layers x 2 sums + the plan; 16 rows of 576 float32 per sum, a ring of 2 sends it once.
    assert "over 2 ranks, a step of 16 tokens: 61 sums, 2.11 MiB sent by each rank, " \
        "122 sequential hops" in out


def test_what_tensor_parallelism_does_not_combine_with_is_refused_by_option(tmp_path):
    with pytest.raises(ValueError, match="does not combine with --kv-cache-dir"):
        EngineConfig(model_dir=tmp_path, tensor_parallel_size=2, kv_cache_dir=tmp_path)
    with pytest.raises(ValueError, match="does not combine with --async-scheduling"):
        EngineConfig(model_dir=tmp_path, tensor_parallel_size=2, async_scheduling=True)


@pytest.mark.parametrize(("family", "layer"), [
    ("minimax_m2", "CrossHeadNormAttention"), ("laguna", "OutputGatedAttention")])
def test_attention_the_split_does_not_know_is_refused_by_class(family, layer, tmp_path):
    """Norms across all heads and output gates hold rows a split by heads would cut wrong."""
    build_tiny_model(family, tmp_path)
    config = ModelConfig.from_model_dir(tmp_path)
    with pytest.raises(ValueError, match=f"does not split {family}'s {layer} layers"):
        shard_model(model_class(family)(config), RankShare(0, 2, lambda x: x))


# Dense with fused projections (Phi-3), experts beside dense layers (Qwen3-MoE), and Gated
# DeltaNet layers with experts and a shared expert (Qwen3-Next).
@pytest.mark.parametrize("family", ["phi3", "qwen3_moe", "qwen3_next"])
def test_two_ranks_give_one_ranks_greedy_tokens(family, tmp_path):
    build_tiny_model(family, tmp_path)
    expected = greedy_tokens(tmp_path)
    assert greedy_tokens_in_a_process(tmp_path, tensor=2) == expected


@pytest.mark.slow
def test_two_ranks_give_one_ranks_greedy_tokens_on_the_default_model(default_model_dir):
    """3 KV heads over 2 ranks: an uneven split."""
    expected = greedy_tokens(default_model_dir)
    assert greedy_tokens_in_a_process(default_model_dir, tensor=2) == expected


@pytest.fixture
def two_rank_server(default_model_dir, tmp_path):
    port = free_port()
    # The drain outlasts a 16-token answer where two ranks on two cores step slowly: ~0.5 s
    # a token on a 2-core Xeon VM, with half of the CPU time spent in the kernel.
    command = [str(Path(sys.executable).parent / "metal-serve"), "serve", str(default_model_dir),
               "--port", str(port), "--tensor-parallel-size", "2", "--kv-cache-memory",
               "128MiB", "--max-model-len", "2048", "--shutdown-timeout", "60"]
    log_path = tmp_path / "server.log"
    with log_path.open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(process, url, log_path, timeout_s=180)
        yield process, url, log_path
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _ranks(process: subprocess.Popen) -> list[int]:
    """The pids of the server's other ranks (its children)."""
    children = Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split()
    return [int(pid) for pid in children]


def _complete(url: str, max_tokens: int, stream: bool = False) -> httpx.Response:
    body = {"model": "default", "prompt": "The capital of France is", "max_tokens": max_tokens,
            "temperature": 0, "stream": stream}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


@pytest.mark.slow
def test_a_two_rank_server_answers_and_drains_both_ranks_on_sigterm(two_rank_server,
                                                                    default_tokenizer):
    process, url, log_path = two_rank_server
    (rank1,) = _ranks(process)
    answer = _complete(url, 8).json()["choices"][0]["text"]
    assert answer == _one_rank_text(default_tokenizer, "The capital of France is", 8)
    with httpx.stream("POST", f"{url}/v1/completions", timeout=120, json={
            "model": "default", "prompt": "Once upon a time", "max_tokens": 16,
            "temperature": 0, "stream": True}) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # streaming now
        process.send_signal(signal.SIGTERM)
        events = [json.loads(line[6:]) for line in lines
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert events[-1]["choices"][0]["finish_reason"] == "length", log_tail(log_path)
    assert process.wait(60) == 0, log_tail(log_path, 40)
    assert not Path(f"/proc/{rank1}").exists() or _is_zombie(rank1)
    assert "rank 1: stopped by rank 0" in log_path.read_text()


def _one_rank_text(tokenizer, prompt: str, max_tokens: int) -> str:
    import convert
    from metal_engine.engine_build import build_engine
    from scheduler import SamplingParams

    engine = build_engine(EngineConfig(model_dir=convert.ensure_default_model(
        progress=False), kv_cache_memory=64 << 20))
    engine.add_request("r", tokenizer.encode(prompt), SamplingParams(max_tokens=max_tokens,
                                                                     temperature=0))
    tokens = []
    while engine.has_unfinished_requests():
        tokens += [t for o in engine.step() for t in o.new_token_ids]
    return tokenizer.decode(tokens)


def _is_zombie(pid: int) -> bool:
    return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"


@pytest.mark.slow
def test_a_lost_rank_fails_the_requests_and_the_server_exits_non_zero(two_rank_server):
    process, url, log_path = two_rank_server
    (rank1,) = _ranks(process)
    with httpx.stream("POST", f"{url}/v1/completions", timeout=60, json={
            "model": "default", "prompt": "Once upon a time", "max_tokens": 2000,
            "temperature": 0, "stream": True}) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        os.kill(rank1, signal.SIGKILL)
        rest = list(lines)
    finished = [json.loads(line[6:]) for line in rest
                if line.startswith("data: ") and line != "data: [DONE]"]
    assert not any(e.get("choices") and e["choices"][0].get("finish_reason") == "length"
                   for e in finished)
    assert any("error" in e for e in finished), rest[-5:]
    started = time.monotonic()
    assert process.wait(60) == 1, log_tail(log_path, 40)
    assert time.monotonic() - started < 60
    assert "rank" in log_tail(log_path, 40)


@pytest.mark.slow
def test_a_rank_lost_while_idle_shuts_the_server_down(two_rank_server):
    process, url, log_path = two_rank_server
    (rank1,) = _ranks(process)
    os.kill(rank1, signal.SIGKILL)
    assert process.wait(60) == 1, log_tail(log_path, 40)
    assert "rank 1 exited with code -9" in log_path.read_text()
