"""K/V writes stay in place while steps are pipelined: no engine step copies a pool.

On the pure-MLX path a step is a lazy graph evaluated asynchronously, as on Metal. MLX
scatters into a pool in place only if nothing else holds the pool's buffer, and work still
queued holds the buffers it reads: a step evaluated behind the previous one would copy the
pools that step still reads. The runner evaluates a step only once the device is done.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import torch
from conftest import TINY_LLAMA
from engine_helpers import make_runner_and_scheduler
from transformers import LlamaConfig, LlamaForCausalLM

from metal_engine.engine import LLMEngine
from metal_engine.models import decoder
from scheduler import SamplingParams

NUM_BLOCKS = 16384  # a 32 MiB pool per layer and K/V: a copy stands out from activations


@pytest.fixture
def pure_mlx(monkeypatch):
    """The forward as one lazy graph, as on Metal: models built with the pure-MLX reference
    ops (no numpy fast paths, reference attention), whose steps are built while the
    previous one runs."""
    monkeypatch.setattr(decoder, "device_ops_name", lambda: "reference")


@pytest.fixture(params=["pure-mlx", "cpu-fast-paths"])
def forward_path(request, monkeypatch):
    """Either the lazy pure-MLX graph or the CPU backend's numpy paths (evaluated eagerly),
    both writing K/V with MLX's scatter: the host forward, which writes into the pool's
    buffer and so cannot copy it, is off."""
    import kernels_metal.cpu.host_forward as host

    monkeypatch.setattr(host, "numpy_serves", lambda: False)
    if request.param == "pure-mlx":
        request.getfixturevalue("pure_mlx")


@pytest.fixture(scope="module")
def one_layer_llama(tmp_path_factory):
    """Few ops per step and a wide MLP: the device falls behind the host, as a GPU does."""
    torch.manual_seed(0)
    config = LlamaConfig(**{**TINY_LLAMA, "num_hidden_layers": 1, "intermediate_size": 1024})
    path = tmp_path_factory.mktemp("one-layer-llama")
    LlamaForCausalLM(config).eval().save_pretrained(path, safe_serialization=True)
    return path


def make_engine(path, tokenizer, async_scheduling: bool, **limits):
    runner, scheduler = make_runner_and_scheduler(
        path, num_blocks=NUM_BLOCKS, max_model_len=4096, **limits
    )
    return LLMEngine(runner, scheduler, tokenizer, "tiny", async_scheduling=async_scheduling)


def add_requests(engine, num_requests: int, prompt_len: int, max_tokens: int) -> None:
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(num_requests):
        engine.add_request(f"r{i}", [int(t) for t in rng.integers(3, 128, prompt_len)], params)


def step_peaks(engine) -> list[int]:
    """Bytes each step allocated beyond what was live when it began, until all finish."""
    peaks = []
    while engine.has_unfinished_requests():
        mx.reset_peak_memory()
        active = mx.get_active_memory()
        engine.step()
        peaks.append(mx.get_peak_memory() - active)
    return peaks


def test_pipelined_decode_steps_never_copy_a_pool(one_layer_llama, default_tokenizer,
                                                  forward_path):
    engine = make_engine(one_layer_llama, default_tokenizer, async_scheduling=True)
    pool_bytes = engine.runner.cache.k[0].nbytes
    add_requests(engine, num_requests=16, prompt_len=40, max_tokens=60)
    peaks = step_peaks(engine)
    assert len(peaks) >= 50
    assert max(peaks) < pool_bytes // 2, [round(p / pool_bytes, 2) for p in peaks]
    # The measurement does see a copy: a second view of a pool makes its write copy it.
    add_requests(engine, num_requests=1, prompt_len=8, max_tokens=4)
    engine.step()
    view = engine.runner.cache.k[0].reshape(-1)
    assert max(step_peaks(engine)) > pool_bytes // 2
    del view


def test_chunked_prefill_steps_never_copy_a_pool(tiny_llama, default_tokenizer, pure_mlx):
    # Steps that only write K/V sample nothing, so nothing waits for them: the next step
    # would be evaluated behind them even without async scheduling.
    engine = make_engine(tiny_llama[1], default_tokenizer, async_scheduling=False,
                         max_num_batched_tokens=32)
    pool_bytes = engine.runner.cache.k[0].nbytes
    add_requests(engine, num_requests=2, prompt_len=800, max_tokens=2)
    peaks = step_peaks(engine)
    assert len(peaks) >= 50
    assert max(peaks) < pool_bytes // 2, [round(p / pool_bytes, 2) for p in peaks]
