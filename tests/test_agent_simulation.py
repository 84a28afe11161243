"""Coding agents on a tiny random Llama, through the scheduler and the real runner.

8 sessions x 4 turns share a ~1k-token system prompt. Each turn resends the whole
conversation with the assistant's answer and a tool result appended, and a session's next
turn starts as soon as its previous one finishes. The test prints the prefix hit rate and the
prefill tokens saved, and holds the hit rate to what a prefix cache must reuse here; a second
test restarts the engine halfway with an on-disk prefix cache and keeps the hits.
"""

from __future__ import annotations

import numpy as np
from agent_sessions import BLOCK, PARAMS, SESSIONS, SYSTEM_LEN, TURNS, Agents, run_turns
from engine_helpers import make_runner_and_scheduler
from scheduler_helpers import run_step

from metal_engine.engine import LLMEngine
from metal_engine.kv_disk.connector import KVDiskConnector, TierStore
from metal_engine.kv_disk.directory import KVDiskDir
from metal_engine.kv_disk.store import BlockLayout, KVDiskStore
from scheduler import Request, Scheduler, SchedulerConfig


def test_agent_sessions_reuse_the_system_prompt_and_their_history(tiny_llama):
    # A budget above the system prompt: without the wait for blocks in flight, the first
    # turns would all compute it side by side in the first step.
    runner, scheduler = make_runner_and_scheduler(
        tiny_llama[1], num_blocks=1024, block_size=BLOCK, max_num_seqs=SESSIONS,
        max_num_batched_tokens=2048, max_model_len=2048,
    )  # fmt: skip
    def add(request_id: str, prompt: list[int]) -> None:
        scheduler.add_request(Request(request_id, prompt, PARAMS, eos_token_ids=(2,)))

    agents = Agents(add, np.random.default_rng(5))
    agents.start(agents.tokens(SYSTEM_LEN))
    computed_prompt_tokens = 0
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        for item in out.scheduled:
            num_prompt = scheduler.requests[item.request_id].num_prompt_tokens
            computed_prompt_tokens += max(0, min(len(item.token_ids),
                                                 num_prompt - item.start_position))
        for update in run_step(runner, scheduler, out):
            if update.finish_reason is not None:
                agents.next_turn(update.request.request_id, update.request.all_token_ids)

    stats = scheduler.prefix_cache.stats
    saved = agents.prompt_tokens - computed_prompt_tokens
    floor = agents.reusable_tokens / agents.prompt_tokens
    print(f"\n{SESSIONS} sessions x {TURNS} turns: prefix hit rate {stats.hit_rate:.1%} "
          f"(floor {floor:.1%}), prefill tokens saved {saved} of {agents.prompt_tokens}")
    assert agents.turns_done == SESSIONS * TURNS
    assert stats.queried_tokens == agents.prompt_tokens  # every request admitted once
    assert stats.hit_tokens == saved  # what the stats report is what was not computed
    assert stats.hit_rate >= floor


def agents_engine(model_dir, tokenizer, kv_dir) -> LLMEngine:
    """An engine whose prefix cache spills to (and loads from) `kv_dir`."""
    runner, _ = make_runner_and_scheduler(model_dir, num_blocks=1024, block_size=BLOCK)
    cache = runner.cache
    layout = BlockLayout(cache.shapes, BLOCK, "float32")
    store = KVDiskStore(KVDiskDir(kv_dir, 1 << 30), "tiny-agents", layout)
    blocks = cache.groups()["blocks"]  # as the engine wires its disk tier
    connector = KVDiskConnector({"blocks": TierStore(store, blocks.read, blocks.write)})
    scheduler = Scheduler(SchedulerConfig(
        num_blocks=1024, block_size=BLOCK, max_num_seqs=SESSIONS, max_num_batched_tokens=2048,
        max_model_len=2048,
    ), connector)  # fmt: skip
    return LLMEngine(runner, scheduler, tokenizer, "tiny", connector=connector)


def test_agent_sessions_keep_their_hits_across_a_restart_with_a_kv_cache_dir(
    tiny_llama, default_tokenizer, tmp_path
):
    prompts: dict[str, list[int]] = {}
    engine = agents_engine(tiny_llama[1], default_tokenizer, tmp_path)

    def add(request_id: str, prompt: list[int]) -> None:
        prompts[request_id] = prompt
        engine.add_request(request_id, prompt, PARAMS)

    first_half = Agents(add, np.random.default_rng(5), turns=TURNS // 2)
    first_half.start(first_half.tokens(SYSTEM_LEN))
    histories = run_turns(engine, first_half, prompts)
    engine.close()

    engine = agents_engine(tiny_llama[1], default_tokenizer, tmp_path)  # the restart
    second_half = Agents(add, np.random.default_rng(6))
    last_turn = TURNS // 2 - 1
    for session in range(SESSIONS):  # each conversation goes on where it stopped
        rid = f"s{session}-t{last_turn}"
        second_half.next_turn(rid, histories[rid])
    run_turns(engine, second_half, prompts)
    stats = engine.scheduler.prefix_cache.stats
    floor = second_half.reusable_tokens / second_half.prompt_tokens
    print(f"\nafter a restart: prefix hit rate {stats.hit_rate:.1%} (floor {floor:.1%}), "
          f"{stats.stored_hit_tokens} tokens loaded from disk")
    assert all(f"s{session}-t{TURNS - 1}" in prompts for session in range(SESSIONS))
    assert stats.hit_rate >= floor and stats.stored_hit_tokens > 0
