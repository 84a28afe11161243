"""Prefix caching for a hybrid model (Qwen3.5: Gated DeltaNet beside full attention): a hit
resumes from a state checkpoint at a block boundary, with the attention blocks before it.

Agent sessions must reuse their previous turn: each turn after the first finds at least 90%
of the conversation it resends cached, and every output equals a run with the cache off; the
same after a restart, from the blocks and checkpoints the first server left on disk.
"""

from __future__ import annotations

import shutil

import numpy as np
from agent_sessions import BLOCK, PARAMS, SESSIONS, SYSTEM_LEN, Agents
from engine_helpers import make_runner_and_scheduler
from scheduler_helpers import run_step
from tiny_models import hf_greedy

from metal_engine.config import EngineConfig
from metal_engine.engine import LLMEngine
from metal_engine.engine_build import build_engine
from scheduler import Request, SamplingParams

MIN_TURN_REUSE = 0.9


def run_agents(model_dir, enable_prefix_caching: bool):
    """Every turn's output ids and cached prompt tokens, and each turn's previous
    conversation length (the tokens a turn may reuse), by request id."""
    runner, scheduler = make_runner_and_scheduler(
        model_dir, num_blocks=1024, block_size=BLOCK, max_num_seqs=SESSIONS,
        max_num_batched_tokens=512, max_model_len=2048,
        enable_prefix_caching=enable_prefix_caching,
    )  # fmt: skip
    previous: dict[str, int] = {}

    def add(request_id: str, prompt: list[int]) -> None:
        scheduler.add_request(Request(request_id, prompt, PARAMS, eos_token_ids=(2,)))

    agents = Agents(add, np.random.default_rng(5))
    agents.start(agents.tokens(SYSTEM_LEN))
    outputs, cached = {}, {}
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        for update in run_step(runner, scheduler, out):
            request = update.request
            if update.finish_reason is None:
                continue
            rid = request.request_id
            outputs[rid], cached[rid] = request.output_token_ids, request.num_cached_tokens
            session, turn = rid.split("-")
            previous[f"{session}-t{int(turn[1:]) + 1}"] = request.num_tokens
            agents.next_turn(rid, request.all_token_ids)
    assert scheduler.group("states").num_free_slots == scheduler.config.num_state_slots
    assert scheduler.pool.num_free_blocks == scheduler.pool.num_blocks
    return outputs, cached, previous


def test_agent_turns_resume_from_checkpoints_and_answer_as_without_the_cache(tiny_hybrid):
    path = tiny_hybrid[1]
    outputs, cached, previous = run_agents(path, enable_prefix_caching=True)
    reuse = {rid: cached[rid] / previous[rid] for rid in outputs if rid in previous}
    print(f"\nhybrid agents: each turn reuses {min(reuse.values()):.1%} or more of the "
          f"conversation before it ({sum(cached.values())} prompt tokens cached)")
    assert len(reuse) == SESSIONS * 3
    assert min(reuse.values()) >= MIN_TURN_REUSE
    uncached, none_cached, _ = run_agents(path, enable_prefix_caching=False)
    assert not any(none_cached.values())
    assert outputs == uncached


def run_restoring(runner, scheduler, requests: list[Request]) -> list[tuple[int, int]]:
    """Run the requests to the end; return the checkpoint restores the steps planned."""
    for request in requests:
        scheduler.add_request(request)
    restores = []
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        restores += out.state_plan.restores
        run_step(runner, scheduler, out)
    return restores


def test_a_resent_prompt_resumes_at_its_last_full_block(tiny_hybrid):
    """The second of two equal prompts (a retry, or `n > 1`) starts from the first's
    checkpoint at the end of its last full block, and writes the same tokens."""
    runner, scheduler = make_runner_and_scheduler(tiny_hybrid[1], num_blocks=64,
                                                  block_size=BLOCK, max_num_seqs=2)
    prompt = [int(t) for t in np.random.default_rng(1).integers(3, 128, size=5 * BLOCK + 3)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    first, second = (Request(rid, prompt, params) for rid in ("a", "b"))
    assert run_restoring(runner, scheduler, [first]) == []
    assert len(run_restoring(runner, scheduler, [second])) == 1
    assert second.num_cached_tokens == 5 * BLOCK
    assert second.output_token_ids == first.output_token_ids


def test_n_choices_fork_from_the_prompt_checkpoint(tiny_hybrid):
    """Choices of one prompt sent together (`n > 1`): one computes the prompt, the others
    wait for its blocks and copy its state at the prompt's last full block, and each writes
    what transformers writes for the prompt alone."""
    model, path = tiny_hybrid
    runner, scheduler = make_runner_and_scheduler(path, num_blocks=64, block_size=BLOCK,
                                                  max_num_seqs=4)
    prompt = [int(t) for t in np.random.default_rng(2).integers(3, 128, size=3 * BLOCK + 5)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    choices = [Request(f"c{i}", prompt, params) for i in range(3)]
    restores = run_restoring(runner, scheduler, choices)
    assert [r.num_cached_tokens for r in choices] == [0, 3 * BLOCK, 3 * BLOCK]
    assert len(restores) == 2
    expected = hf_greedy(model, prompt, 8)
    assert all(r.output_token_ids == expected for r in choices)


def hybrid_engine(model_dir, kv_dir, enable_prefix_caching: bool = True) -> LLMEngine:
    return build_engine(EngineConfig(
        model_dir=model_dir, dtype="float32", max_num_seqs=SESSIONS, kv_cache_memory=64 << 20,
        max_num_batched_tokens=512, max_model_len=2048, allow_long_max_model_len=True,
        kv_cache_dir=kv_dir,
        enable_prefix_caching=enable_prefix_caching,
    ))  # fmt: skip


def serve_turns(engine: LLMEngine, prompts: dict[str, list[int]], agents: Agents | None = None):
    """Step until every submitted turn (and those they lead to, with `agents`) has finished;
    return each turn's conversation (prompt and answer) and its cached prompt tokens."""
    histories, cached = {}, {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            rid = output.request_id
            histories[rid] = histories.get(rid, prompts[rid]) + output.new_token_ids
            if output.finished:
                cached[rid] = output.num_cached_tokens
                if agents is not None:
                    agents.next_turn(rid, histories[rid])
    return histories, cached


def test_a_restart_with_a_kv_cache_dir_resumes_conversations_from_disk(
    tiny_hybrid, default_tokenizer, tmp_path
):
    served = tmp_path / "model"
    shutil.copytree(tiny_hybrid[1], served)
    default_tokenizer.save_pretrained(served)
    prompts: dict[str, list[int]] = {}
    engine = hybrid_engine(served, tmp_path / "kv")

    def add(request_id: str, prompt: list[int]) -> None:
        prompts[request_id] = prompt
        engine.add_request(request_id, prompt, PARAMS)

    first_half = Agents(add, np.random.default_rng(5), turns=2)
    first_half.start(first_half.tokens(SYSTEM_LEN))
    histories, _ = serve_turns(engine, prompts, first_half)
    engine.close()

    engine = hybrid_engine(served, tmp_path / "kv")  # the restart: nothing in memory
    second_half = Agents(add, np.random.default_rng(6))
    for session in range(SESSIONS):  # each conversation goes on where it stopped
        second_half.next_turn(f"s{session}-t1", histories[f"s{session}-t1"])
    resumed, cached = serve_turns(engine, prompts, second_half)
    stats = engine.scheduler.prefix_cache.stats
    reuse = {rid: cached[rid] / len(histories[rid.replace("-t2", "-t1")])
             for rid in cached if rid.endswith("-t2")}
    print(f"\nafter a restart: each conversation resumes {min(reuse.values()):.1%} or more "
          f"cached, {stats.stored_hit_tokens} tokens loaded from disk")
    assert len(reuse) == SESSIONS and min(reuse.values()) >= MIN_TURN_REUSE
    assert stats.stored_hit_tokens > 0

    engine = hybrid_engine(served, None, enable_prefix_caching=False)
    for rid in resumed:
        engine.add_request(rid, prompts[rid], PARAMS)
    uncached, _ = serve_turns(engine, prompts)
    assert resumed == uncached
