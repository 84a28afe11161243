"""The MLX Llama through the paged cache against transformers (PyTorch, fp32, CPU)."""

from __future__ import annotations

import numpy as np
import torch
from engine_helpers import generate_greedy, make_runner_and_scheduler

from scheduler import Request, SamplingParams

TOL = 1e-4


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
        rows.append(np.array(runner.forward_logits(out)))
        request.num_computed_tokens += len(out.scheduled[0].token_ids)
    return np.concatenate(rows)


def test_full_prefill_logits_match_transformers(tiny_llama):
    model, path = tiny_llama
    runner, scheduler = make_runner_and_scheduler(path, block_size=16)
    ids = list(np.random.default_rng(1).integers(3, 128, size=45))  # crosses 2 block boundaries
    got = run_logits(runner, scheduler, "a", ids, chunk=len(ids))
    np.testing.assert_allclose(got, torch_logits(model, ids), atol=TOL, rtol=TOL)


def test_token_by_token_decode_logits_match_transformers(tiny_llama):
    model, path = tiny_llama
    runner, scheduler = make_runner_and_scheduler(path, block_size=8)
    ids = list(np.random.default_rng(2).integers(3, 128, size=37))
    got = run_logits(runner, scheduler, "b", ids, chunk=1)
    np.testing.assert_allclose(got, torch_logits(model, ids), atol=TOL, rtol=TOL)


def test_chunked_prefill_logits_match_transformers(tiny_llama):
    model, path = tiny_llama
    runner, scheduler = make_runner_and_scheduler(path, block_size=16)
    ids = list(np.random.default_rng(3).integers(3, 128, size=50))
    got = run_logits(runner, scheduler, "c", ids, chunk=7)
    np.testing.assert_allclose(got, torch_logits(model, ids), atol=TOL, rtol=TOL)


def hf_greedy(model, ids: list[int], max_new: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=max_new, min_new_tokens=max_new,
            do_sample=False, pad_token_id=0,
        )
    return out[0, len(ids):].tolist()


def test_mixed_batch_greedy_matches_alone_and_transformers(tiny_llama):
    model, path = tiny_llama
    rng = np.random.default_rng(4)
    prompts = {f"r{i}": list(rng.integers(3, 128, size=n)) for i, n in
               enumerate([3, 17, 40, 9, 64, 1, 25, 33])}
    max_tokens = 12
    # A small budget forces prefill chunks and decodes into the same steps.
    runner, scheduler = make_runner_and_scheduler(path, max_num_batched_tokens=24)
    together = generate_greedy(runner, scheduler, prompts, max_tokens)
    for rid, ids in prompts.items():
        runner, scheduler = make_runner_and_scheduler(path)
        alone = generate_greedy(runner, scheduler, {rid: ids}, max_tokens)[rid]
        assert together[rid] == alone, rid
        assert together[rid] == hf_greedy(model, ids, max_tokens), rid
