"""Every supported family through the paged engine against transformers (PyTorch, fp32, CPU).

One runner over all families: each tiny random checkpoint is converted with `convert_model`
and loaded by the engine; logits of a whole-prompt prefill, of chunked prefill and of
token-by-token decode must equal PyTorch's, and greedy tokens of a mixed batch run together
must equal `generate` per prompt. Prompts are several times longer than the sliding windows.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import torch
from engine_helpers import generate_greedy, make_runner_and_scheduler
from tiny_models import TINY_MODELS, VOCAB, build_tiny_model, hf_greedy

from convert import convert_model
from scheduler import Request, SamplingParams

TOL = 1e-4


@pytest.fixture(scope="module", params=list(TINY_MODELS))
def tiny_model(request, tmp_path_factory):
    """(torch model, converted model dir) of one family."""
    source = tmp_path_factory.mktemp(f"{request.param}-hf")
    model = build_tiny_model(request.param, source)
    out = convert_model(source, tmp_path_factory.mktemp(request.param) / "model",
                        progress=False)
    return model, out


def torch_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def run_logits(runner, scheduler, rid: str, ids: list[int], chunk: int) -> np.ndarray:
    """Feed `ids` through the engine `chunk` tokens per step; logits of every fed position."""
    request = Request(rid, ids, SamplingParams(max_tokens=1, temperature=0.0))
    scheduler.add_request(request)
    rows = []
    while request.num_computed_tokens < len(ids):
        out = scheduler.schedule()
        out.scheduled[0].token_ids = out.scheduled[0].token_ids[:chunk]
        out.scheduled[0].samples = False
        rows.append(np.array(runner.forward_logits(out).astype(mx.float32)))
        request.num_computed_tokens += len(out.scheduled[0].token_ids)
    return np.concatenate(rows)


def random_ids(seed: int, n: int) -> list[int]:
    return [int(i) for i in np.random.default_rng(seed).integers(3, VOCAB, size=n)]


@pytest.mark.parametrize(("block_size", "chunk"), [(16, 45), (16, 7), (8, 1)],
                         ids=["whole-prompt", "chunked", "token-by-token"])
def test_logits_match_transformers(tiny_model, block_size, chunk):
    model, path = tiny_model
    runner, scheduler = make_runner_and_scheduler(path, block_size=block_size)
    ids = random_ids(chunk, 45)  # crosses blocks, 5x the shortest window
    got = run_logits(runner, scheduler, "a", ids, chunk=chunk)
    np.testing.assert_allclose(got, torch_logits(model, ids), atol=TOL, rtol=TOL)


def test_a_long_prefill_chunk_matches_transformers(tiny_model):
    """A 100-token chunk: on the CPU backend its attention folds blocks of keys (cpu_prefill)
    where shorter chunks go to cpu_decode's rows."""
    model, path = tiny_model
    runner, scheduler = make_runner_and_scheduler(path, block_size=16)
    ids = random_ids(100, 120)
    got = run_logits(runner, scheduler, "a", ids, chunk=100)
    np.testing.assert_allclose(got, torch_logits(model, ids), atol=TOL, rtol=TOL)


def test_mixed_batch_greedy_matches_transformers(tiny_model):
    model, path = tiny_model
    prompts = {f"r{i}": random_ids(10 + i, n) for i, n in enumerate([3, 17, 40, 9, 26, 1])}
    max_tokens = 10
    # A small budget forces prefill chunks and decodes into the same steps.
    runner, scheduler = make_runner_and_scheduler(path, block_size=8, max_num_batched_tokens=24)
    together = generate_greedy(runner, scheduler, prompts, max_tokens)
    for rid, ids in prompts.items():
        assert together[rid] == hf_greedy(model, ids, max_tokens), rid


@pytest.mark.parametrize("backend", ["metal", "reference"])
@pytest.mark.parametrize(("block_size", "chunk"), [(16, 7), (8, 1)],
                         ids=["chunked", "token-by-token"])
def test_every_backend_matches_transformers(tiny_model, backend, block_size, chunk):
    """The Metal path's graph (`mx.fast` rope and norms, packed products, compiled chains;
    its kernels' stand-in off a Mac is the dispatcher's fallback) and the pure-MLX
    reference, run here on MLX's CPU backend."""
    model, path = tiny_model
    runner, scheduler = make_runner_and_scheduler(path, block_size=block_size)
    runner.model.use_ops(backend)
    ids = random_ids(chunk, 45)
    got = run_logits(runner, scheduler, "a", ids, chunk=chunk)
    np.testing.assert_allclose(got, torch_logits(model, ids), atol=TOL, rtol=TOL)
