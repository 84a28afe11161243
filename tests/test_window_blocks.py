"""Sliding-window layers beside full ones keep blocks of their own, and give back each block
once no row of its request can see it again (scheduler.cache_groups.sliding_window).

Through the scheduler alone: every step a request holds the blocks its rows see, and no
more; a prefix hit takes only the window's blocks. Through a Gemma-3-style model: 32 requests
at 4x the window hold window-sized KV per windowed layer, and answer as transformers does;
a restart with a KV cache dir finds both groups' blocks on disk.
"""

from __future__ import annotations

import numpy as np
import pytest
from engine_helpers import make_runner_and_scheduler
from scheduler_helpers import resolve_step, run_step
from tiny_models import VOCAB, build_tiny_model, hf_greedy

from convert import convert_model
from metal_engine.config import EngineConfig
from metal_engine.engine import LLMEngine
from metal_engine.engine_build import build_engine
from scheduler import Request, SamplingParams, Scheduler, SchedulerConfig
from scheduler.block_pool import cdiv
from scheduler.cache_groups.sliding_window import NULL_BLOCK

BLOCK, WINDOW = 4, 10


def window_scheduler(num_window_blocks: int = 64, budget: int = 12) -> Scheduler:
    return Scheduler(SchedulerConfig(
        num_blocks=64, block_size=BLOCK, max_num_seqs=4, max_num_batched_tokens=budget,
        max_model_len=128, window=WINDOW, num_window_blocks=num_window_blocks,
    ))  # fmt: skip


def run(scheduler: Scheduler, requests: list[Request], check=None) -> None:
    for request in requests:
        scheduler.add_request(request)
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        if check is not None:
            check(out)
        resolve_step(scheduler, out, {s.request_id: 5 for s in out.scheduled if s.samples})


def test_a_request_holds_the_blocks_its_rows_see_and_no_more():
    scheduler = window_scheduler()
    request = Request("a", list(range(3, 43)), SamplingParams(max_tokens=20, ignore_eos=True))
    held = []

    def check(out):
        for item in out.scheduled:
            first_key = max(item.start_position - WINDOW + 1, 0)
            end = item.start_position + len(item.token_ids)
            table = item.group_ids["window"]
            assert NULL_BLOCK not in table[first_key // BLOCK : cdiv(end, BLOCK)]
            assert all(b == NULL_BLOCK for b in table[: first_key // BLOCK])
            held.append(sum(b != NULL_BLOCK for b in table))

    run(scheduler, [request], check)
    assert max(held) <= cdiv(WINDOW - 1, BLOCK) + 1 + cdiv(12, BLOCK)  # window + a chunk
    assert held[-1] <= cdiv(WINDOW - 1, BLOCK) + 1  # decoding: the window alone
    assert scheduler.group("window").num_free_blocks == 64 - 1  # all back but the null block


def test_a_prefix_hit_takes_only_the_window_of_its_cached_blocks():
    scheduler = window_scheduler()
    prompt = list(range(3, 33))  # 7 full blocks before the last token
    first = Request("a", prompt, SamplingParams(max_tokens=2, ignore_eos=True))
    second = Request("b", prompt, SamplingParams(max_tokens=2, ignore_eos=True))
    run(scheduler, [first])
    starts = []
    run(scheduler, [second], lambda out: starts.append(out.scheduled[0].group_ids["window"]))
    assert second.num_cached_tokens == 7 * BLOCK
    table = starts[0]
    seen_from = (7 * BLOCK - WINDOW + 1) // BLOCK
    assert table[:seen_from] == [NULL_BLOCK] * seen_from and NULL_BLOCK not in table[seen_from:]


def test_a_hit_stops_where_the_window_blocks_it_needs_were_reused():
    scheduler = window_scheduler(num_window_blocks=13, budget=32)
    prompt = list(range(3, 33))
    run(scheduler, [Request("a", prompt, SamplingParams(max_tokens=1))])
    other = [int(t) for t in np.random.default_rng(0).integers(40, 90, size=30)]
    run(scheduler, [Request("churn", other, SamplingParams(max_tokens=1))])  # reuses them
    again = Request("b", prompt, SamplingParams(max_tokens=1))
    run(scheduler, [again])
    assert again.num_cached_tokens < 7 * BLOCK  # full blocks alone are not a hit


def test_32_requests_at_4x_the_window_hold_window_sized_kv(tmp_path):
    window, block = 32, 16
    model = build_tiny_model("gemma3_text", tmp_path / "hf", sliding_window=window)
    path = convert_model(tmp_path / "hf", tmp_path / "model", progress=False)
    runner, scheduler = make_runner_and_scheduler(path, num_blocks=400, block_size=block,
                                                  max_num_seqs=32, max_num_batched_tokens=256)
    rng = np.random.default_rng(3)
    prompts = {f"r{i}": [int(t) for t in rng.integers(3, VOCAB, size=4 * window)]
               for i in range(32)}  # fmt: skip
    # Long enough answers that the last prompt is in before the first one ends.
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    requests = [Request(rid, ids, params) for rid, ids in prompts.items()]
    for request in requests:
        scheduler.add_request(request)
    peak_full = peak_window = 0
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        decoding = all(len(s.token_ids) == 1 for s in out.scheduled) and len(out.scheduled) == 32
        if decoding:  # all 32 past 4x the window: what each holds
            peak_full = max(peak_full, scheduler.pool.num_used_blocks)
            peak_window = max(peak_window, scheduler.group("window").pool.num_used_blocks - 1)
        run_step(runner, scheduler, out)
    per_request = peak_window / 32 * block
    print(f"\n32 requests at {4 * window} tokens, window {window}: each holds "
          f"{per_request:.0f} tokens of KV per windowed layer, "
          f"{peak_full / 32 * block:.0f} per full layer")
    assert peak_full and per_request <= (cdiv(window - 1, block) + 1) * block  # 48 tokens
    for request in requests[:4]:
        expected = hf_greedy(model, prompts[request.request_id], 32)
        assert request.output_token_ids == expected


def window_engine(model_dir, kv_dir, enable_prefix_caching: bool = True) -> LLMEngine:
    return build_engine(EngineConfig(
        model_dir=model_dir, dtype="float32", max_num_seqs=4, kv_cache_memory=8 << 20,
        max_num_batched_tokens=64, kv_cache_dir=kv_dir,
        enable_prefix_caching=enable_prefix_caching,
    ))  # fmt: skip


def serve(engine: LLMEngine, prompts: dict[str, list[int]]) -> tuple[dict, dict]:
    """Each prompt's output ids and cached prompt tokens."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, params)
    outputs, cached = {rid: [] for rid in prompts}, {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[output.request_id] += output.new_token_ids
            if output.finished:
                cached[output.request_id] = output.num_cached_tokens
    return outputs, cached


def test_a_restart_with_a_kv_cache_dir_keeps_the_window_groups_hits(
    tmp_path, default_tokenizer
):
    window = 24
    build_tiny_model("gemma3_text", tmp_path / "hf", sliding_window=window)
    path = convert_model(tmp_path / "hf", tmp_path / "model", progress=False)
    default_tokenizer.save_pretrained(path)
    rng = np.random.default_rng(4)
    first = {f"r{i}": [int(t) for t in rng.integers(3, VOCAB, size=100)] for i in range(4)}
    engine = window_engine(path, tmp_path / "kv")
    assert engine.scheduler.group("window") is not None
    answers, _ = serve(engine, first)
    engine.close()
    namespaces = [p for p in (tmp_path / "kv").iterdir() if p.is_dir()]
    assert len(namespaces) == 2  # the full and the window group's stores

    follow_ups = {f"{rid}-2": ids + answers[rid] + [int(t) for t in rng.integers(3, VOCAB, 9)]
                  for rid, ids in first.items()}  # fmt: skip
    engine = window_engine(path, tmp_path / "kv")  # the restart: nothing in memory
    resumed, cached = serve(engine, follow_ups)
    stats = engine.scheduler.prefix_cache.stats
    assert stats.stored_hit_tokens > 0
    assert all(cached[rid] >= 96 for rid in follow_ups)  # its 100 prompt tokens, in blocks
    uncached, _ = serve(window_engine(path, None, enable_prefix_caching=False), follow_ups)
    assert resumed == uncached


def test_a_window_group_too_small_for_one_request_is_refused():
    with pytest.raises(ValueError, match="cannot hold a window of 10 and a 12-token step"):
        window_scheduler(num_window_blocks=7)
