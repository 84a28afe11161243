"""Build engine parts around a model dir without a tokenizer, for model-level tests."""

from __future__ import annotations

import mlx.core as mx

from metal_engine.kv_cache import KVCache
from metal_engine.runner import ModelRunner
from metal_engine.weights import load_model
from scheduler import Request, SamplingParams, Scheduler, SchedulerConfig


def make_runner_and_scheduler(model_dir, num_blocks=64, block_size=16, max_num_seqs=16,
                              max_num_batched_tokens=512, max_model_len=512,
                              enable_prefix_caching=True, state_checkpoint_interval=32):
    model = load_model(model_dir, mx.float32)
    cfg = model.config
    # Hybrid models: a live state slot per request that can run, two checkpoints for each.
    num_state_slots = 3 * max_num_seqs if cfg.linear_attention is not None else 0
    cache = KVCache.for_model(cfg, num_blocks, block_size, mx.float32,
                              num_slots=num_state_slots)
    scheduler = Scheduler(SchedulerConfig(
        num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
        enable_prefix_caching=enable_prefix_caching, num_state_slots=num_state_slots,
        state_checkpoint_interval=state_checkpoint_interval,
    ))
    return ModelRunner(model, cache), scheduler


def generate_greedy(runner, scheduler, prompts: dict[str, list[int]], max_tokens: int,
                    ignore_eos: bool = True) -> dict[str, list[int]]:
    """Run all prompts to completion through the packed step; return output ids per request."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)
    requests = {}
    for rid, ids in prompts.items():
        requests[rid] = Request(rid, ids, params, eos_token_ids=(2,))
        scheduler.add_request(requests[rid])
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        scheduler.update(out, runner.execute(out))
    return {rid: r.output_token_ids for rid, r in requests.items()}
