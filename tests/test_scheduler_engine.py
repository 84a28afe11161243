"""The scheduler driving the real runner on a tiny random Llama: a prefix shared by requests
that arrive together is computed once, and a pool too small for every request at once still
finishes them all. Greedy tokens must equal each prompt's run alone. The engine's per-step
token budget defaults by device."""

from __future__ import annotations

from collections import Counter

import mlx.core as mx
import numpy as np
import pytest
from engine_helpers import generate_greedy, make_runner_and_scheduler
from scheduler_helpers import run_step

from metal_engine.config import EngineConfig, default_token_budget
from metal_engine.engine_build import build_engine
from scheduler import Request, SamplingParams, Scheduler, SchedulerConfig

BLOCK = 8
RNG = np.random.default_rng(11)


def random_tokens(count: int) -> list[int]:
    return [int(t) for t in RNG.integers(3, 128, size=count)]


def solo_greedy(path, prompt: list[int], max_tokens: int) -> list[int]:
    """The reference: greedy output alone in a roomy pool, prefix caching off."""
    runner, scheduler = make_runner_and_scheduler(path, block_size=BLOCK,
                                                  enable_prefix_caching=False)
    return generate_greedy(runner, scheduler, {"solo": prompt}, max_tokens)["solo"]


def add(scheduler: Scheduler, rid: str, prompt: list[int], max_tokens: int,
        priority: int = 0) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    request = Request(rid, prompt, params, eos_token_ids=(2,), priority=priority)
    scheduler.add_request(request)
    return request


def prompt_tokens_scheduled(scheduler: Scheduler, out) -> Counter:
    """Prompt tokens (not output tokens being recomputed or decoded) each request feeds."""
    counts = Counter()
    for item in out.scheduled:
        num_prompt = scheduler.requests[item.request_id].num_prompt_tokens
        end = min(item.start_position + len(item.token_ids), num_prompt)
        counts[item.request_id] += max(0, end - item.start_position)
    return counts


def test_identical_prompts_arriving_together_compute_their_prefix_once(tiny_llama):
    path = tiny_llama[1]
    prompt = random_tokens(3 * BLOCK + 5)
    runner, scheduler = make_runner_and_scheduler(path, block_size=BLOCK)
    first, second = (add(scheduler, rid, prompt, 6) for rid in ("first", "second"))
    prefill = Counter()
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        prefill += prompt_tokens_scheduled(scheduler, out)
        run_step(runner, scheduler, out)
    assert prefill == {"first": len(prompt), "second": len(prompt) - 3 * BLOCK}
    assert second.num_cached_tokens == 3 * BLOCK
    assert scheduler.prefix_cache.stats.hit_tokens == 3 * BLOCK
    expected = solo_greedy(path, prompt, 6)
    assert first.output_token_ids == expected and second.output_token_ids == expected


def small_pool(path, num_blocks: int, policy: str) -> tuple:
    runner, _ = make_runner_and_scheduler(path, num_blocks=num_blocks, block_size=BLOCK)
    scheduler = Scheduler(SchedulerConfig(
        num_blocks=num_blocks, block_size=BLOCK, max_num_seqs=16, max_num_batched_tokens=512,
        max_model_len=512, scheduling_policy=policy,
    ))
    return runner, scheduler


@pytest.mark.parametrize(
    ("policy", "priorities"), [("fcfs", [0, 0, 0, 0, 0]), ("priority", [2, 0, 1, 0, 2])]
)
def test_pool_too_small_for_all_requests_at_once_finishes_them_all(tiny_llama, policy,
                                                                    priorities):
    path = tiny_llama[1]
    max_tokens = 20
    prompts = {f"r{i}": random_tokens(17 + 2 * i) for i in range(len(priorities))}
    # Each request needs at most 6 blocks; together they need 30 and the pool has 12.
    runner, scheduler = small_pool(path, num_blocks=12, policy=policy)
    requests = [add(scheduler, rid, prompt, max_tokens, priority)
                for (rid, prompt), priority in zip(prompts.items(), priorities, strict=True)]
    preemptions = steps = 0
    while scheduler.has_unfinished_requests():
        running_before = set(scheduler.running)
        out = scheduler.schedule()
        preemptions += len(running_before - set(scheduler.running))  # finishing is in update
        run_step(runner, scheduler, out)
        steps += 1
        assert steps < 400, "the requests did not all finish: deadlock or starvation"
    assert preemptions > 0
    for request in requests:
        assert request.finish_reason == "length"
        assert request.output_token_ids == solo_greedy(path, prompts[request.request_id],
                                                       max_tokens)
    assert scheduler.pool.num_free_blocks == 12


def test_the_step_token_budget_defaults_by_device_unless_set(tiny_llama_with_tokenizer):
    def budget(**options) -> int:
        engine = build_engine(EngineConfig(
            model_dir=tiny_llama_with_tokenizer, kv_cache_memory=4 << 20, max_model_len=256,
            **options))
        return engine.scheduler.config.max_num_batched_tokens

    assert (default_token_budget(on_gpu=False), default_token_budget(on_gpu=True)) == (256, 512)
    assert budget() == default_token_budget(on_gpu=mx.metal.is_available())
    assert budget(max_num_batched_tokens=1000) == 1000
