"""Prefix caching through the real runner: fewer tokens computed, the same greedy tokens."""

from __future__ import annotations

import numpy as np
from engine_helpers import generate_greedy, make_runner_and_scheduler
from scheduler_helpers import run_step

from scheduler import Request, SamplingParams

BLOCK = 8
RNG = np.random.default_rng(7)
SHARED = [int(t) for t in RNG.integers(3, 128, size=3 * BLOCK)]
FIRST = SHARED + [int(t) for t in RNG.integers(3, 128, size=6)]
SECOND = SHARED + [int(t) for t in RNG.integers(3, 128, size=5)]


def reference(path, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy output with prefix caching off, alone in a fresh cache."""
    runner, scheduler = make_runner_and_scheduler(path, block_size=BLOCK,
                                                  enable_prefix_caching=False)
    return generate_greedy(runner, scheduler, {"ref": prompt}, max_tokens)["ref"]


def add(scheduler, rid: str, prompt: list[int], max_tokens: int) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    request = Request(rid, prompt, params, eos_token_ids=(2,))
    scheduler.add_request(request)
    return request


def step(runner, scheduler, logits_of: str | None = None):
    """One step; (start position, token count) per scheduled request.

    With `logits_of`, also the logits of that request's last row (its K/V are written twice,
    with the same values).
    """
    out = scheduler.schedule()
    logits = None
    if logits_of is not None:
        rows = np.array(runner.forward_logits(out))
        ends = np.cumsum([len(s.token_ids) for s in out.scheduled]) - 1
        ids = [s.request_id for s in out.scheduled]
        logits = rows[ends[ids.index(logits_of)]]
    run_step(runner, scheduler, out)
    counts = {s.request_id: (s.start_position, len(s.token_ids)) for s in out.scheduled}
    return counts if logits_of is None else (counts, logits)


def reference_logits(path, prompt: list[int]) -> np.ndarray:
    """Last-row logits of the whole prompt, prefix caching off."""
    runner, scheduler = make_runner_and_scheduler(path, block_size=BLOCK,
                                                  enable_prefix_caching=False)
    add(scheduler, "ref", prompt, 1)
    return step(runner, scheduler, logits_of="ref")[1]


def run_to_end(runner, scheduler) -> None:
    while scheduler.has_unfinished_requests():
        step(runner, scheduler)


def test_prefix_of_a_finished_request_is_reused(tiny_llama):
    path = tiny_llama[1]
    runner, scheduler = make_runner_and_scheduler(path, block_size=BLOCK)
    first = add(scheduler, "first", FIRST, 4)
    run_to_end(runner, scheduler)
    second = add(scheduler, "second", SECOND, 6)
    counts, logits = step(runner, scheduler, logits_of="second")
    assert counts == {"second": (3 * BLOCK, len(SECOND) - 3 * BLOCK)}
    np.testing.assert_allclose(logits, reference_logits(path, SECOND), atol=1e-4, rtol=1e-4)
    assert second.num_cached_tokens == 3 * BLOCK
    run_to_end(runner, scheduler)
    assert first.output_token_ids == reference(path, FIRST, 4)
    assert second.output_token_ids == reference(path, SECOND, 6)


def test_prefix_of_a_running_request_is_shared(tiny_llama):
    path = tiny_llama[1]
    runner, scheduler = make_runner_and_scheduler(path, block_size=BLOCK)
    first = add(scheduler, "first", FIRST, 12)
    step(runner, scheduler)  # prefill: its 3 full blocks are cached while it decodes
    second = add(scheduler, "second", SECOND, 8)
    counts, logits = step(runner, scheduler, logits_of="second")
    assert counts == {"first": (len(FIRST), 1), "second": (3 * BLOCK, len(SECOND) - 3 * BLOCK)}
    np.testing.assert_allclose(logits, reference_logits(path, SECOND), atol=1e-4, rtol=1e-4)
    assert second.block_ids[:3] == first.block_ids[:3]
    run_to_end(runner, scheduler)
    assert first.output_token_ids == reference(path, FIRST, 12)
    assert second.output_token_ids == reference(path, SECOND, 8)
    assert scheduler.prefix_cache.stats.hit_tokens == 3 * BLOCK
