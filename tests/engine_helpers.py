"""Build engine parts around a model dir without a tokenizer, for model-level tests."""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
from scheduler_helpers import run_step

from metal_engine.cache.cache_plan import CachePlan, window_blocks
from metal_engine.cache.kv_cache import KVCache
from metal_engine.drafting.draft_model import DraftModel
from metal_engine.drafting.mtp import MtpDrafter, head_cache, load_mtp_head, with_draft_length
from metal_engine.loading.weights import load_model
from metal_engine.runner import ModelRunner
from scheduler import Request, SamplingParams, Scheduler, SchedulerConfig


def make_runner_and_scheduler(model_dir, num_blocks=64, block_size=16, max_num_seqs=16,
                              max_num_batched_tokens=512, max_model_len=512,
                              enable_prefix_caching=True, state_checkpoint_interval=32,
                              speculative=None, draft_dir=None, dtype=mx.float32,
                              kv_quant=None):
    """`draft_dir`: a draft model for `speculative` (method draft_model), K/V beside the pool;
    method mtp drafts with the model dir's own head. Weights and K/V in `dtype`, or K/V as
    `kv_quant`'s codes and scales."""
    model = load_model(model_dir, dtype)
    if speculative is not None and speculative.method == "mtp":
        speculative = with_draft_length(speculative)
    cfg = model.config
    plan = CachePlan(num_blocks, 0)
    if cfg.linear_attention is not None:  # a live state slot per request, two checkpoints each
        plan = replace(plan, num_state_slots=3 * max_num_seqs)
    if cfg.windowed_pools():  # windowed layers beside full ones: blocks of their own
        plan = replace(plan, windowed_pools=tuple(cfg.windowed_pools()), window=cfg.sliding_window,
                       num_window_blocks=window_blocks(cfg.sliding_window, block_size,
                                                       max_num_seqs, max_num_batched_tokens))
    cache = KVCache.for_model(cfg, plan, block_size, dtype, kv_quant)
    scheduler = Scheduler(SchedulerConfig(
        num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
        enable_prefix_caching=enable_prefix_caching, kv_kind=cfg.kv_kind,
        num_state_slots=plan.num_state_slots,
        state_checkpoint_interval=state_checkpoint_interval, window=plan.window,
        num_window_blocks=plan.num_window_blocks, speculative=speculative,
    ))
    draft = None
    if draft_dir is not None:
        draft_model = load_model(draft_dir, mx.float32)
        draft_cache = KVCache.for_model(draft_model.config, CachePlan(num_blocks, 0), block_size,
                                        mx.float32)
        draft = DraftModel(draft_model, draft_cache)
    elif speculative is not None and speculative.method == "mtp":
        head = load_mtp_head(model_dir, model, mx.float32)
        draft = MtpDrafter(model, head, head_cache(head, cfg.kv_kind, num_blocks, block_size,
                                                   mx.float32))
    return ModelRunner(model, cache, draft), scheduler


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
        run_step(runner, scheduler, out)
    return {rid: r.output_token_ids for rid, r in requests.items()}


def greedy_after_preemptions(model_dir, prompts: dict[str, list[int]], num_blocks: int,
                             max_new: int = 10) -> dict[str, list[int]]:
    """Each prompt's greedy tokens, all run at once in a pool of `num_blocks` blocks of 8 too
    small for them together (asserted: at least one is preempted)."""
    runner, scheduler = make_runner_and_scheduler(model_dir, num_blocks=num_blocks, block_size=8,
                                                  max_num_seqs=4, max_model_len=64)
    params = SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True)
    requests = [Request(rid, ids, params, eos_token_ids=(2,)) for rid, ids in prompts.items()]
    assert run_counting_preemptions(runner, scheduler, requests) > 0
    return {request.request_id: request.output_token_ids for request in requests}


def run_counting_preemptions(runner, scheduler, requests: list[Request]) -> int:
    """Run `requests` to completion through the packed step; how many times one was
    preempted."""
    for request in requests:
        scheduler.add_request(request)
    preemptions = 0
    while scheduler.has_unfinished_requests():
        running_before = set(scheduler.running)
        out = scheduler.schedule()
        preemptions += len(running_before - set(scheduler.running))
        run_step(runner, scheduler, out)
        runner.release(out.finished_ids)
    return preemptions
