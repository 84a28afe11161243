"""A hybrid model (Qwen3.5: Gated DeltaNet layers beside full attention) through the scheduler
and the engine: linear-attention state lives in slots the scheduler hands out, freed when a
request ends or is preempted (it then resumes from a checkpoint or starts over), so every
request's greedy tokens equal `transformers.generate` of its prompt alone."""

from __future__ import annotations

import logging
import shutil

import numpy as np
from engine_helpers import make_runner_and_scheduler, run_counting_preemptions
from tiny_models import VOCAB, hf_greedy

from metal_engine.config import EngineConfig
from metal_engine.engine_build import build_engine
from scheduler import Request, SamplingParams

MAX_TOKENS = 12


def prompts(count: int) -> dict[str, list[int]]:
    rng = np.random.default_rng(5)
    return {f"r{i}": [int(t) for t in rng.integers(3, VOCAB, size=17 + 3 * i)]
            for i in range(count)}  # fmt: skip


def test_preempted_and_finished_requests_leave_their_slots_right(tiny_hybrid):
    model, path = tiny_hybrid
    asked = prompts(6)
    # Each request needs up to 5 blocks of 8; together they need ~28 and the pool has 12, and
    # 6 requests share 4 state slots.
    runner, scheduler = make_runner_and_scheduler(path, num_blocks=12, block_size=8,
                                                  max_num_seqs=4, max_model_len=96)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    requests = [Request(rid, ids, params, eos_token_ids=(2,)) for rid, ids in asked.items()]
    assert run_counting_preemptions(runner, scheduler, requests) > 0
    for request in requests:
        expected = hf_greedy(model, asked[request.request_id], MAX_TOKENS)
        assert request.output_token_ids == expected
    assert scheduler.group("states").num_free_slots == scheduler.config.num_state_slots


def test_the_engine_serves_a_hybrid_model_with_prefix_caching(tiny_hybrid, default_tokenizer,
                                                              tmp_path, caplog):
    model, path = tiny_hybrid
    served = tmp_path / "model"
    shutil.copytree(path, served)
    default_tokenizer.save_pretrained(served)
    with caplog.at_level(logging.INFO, logger="metal_engine.engine_build"):
        engine = build_engine(EngineConfig(model_dir=served, dtype="float32",
                                                    max_num_seqs=4, kv_cache_memory=1 << 22))
    assert engine.scheduler.config.enable_prefix_caching
    assert "recurrent state: 12 slots" in caplog.text  # 4 live, 8 for checkpoints
    asked = prompts(3)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    got: dict[str, list[int]] = {}
    for rounds in range(2):  # the second round resumes from the first's checkpoints
        for rid, ids in asked.items():
            engine.add_request(f"{rid}-{rounds}", ids, params)
        while engine.has_unfinished_requests():
            for output in engine.step():
                got.setdefault(output.request_id, []).extend(output.new_token_ids)
                if output.finished and rounds:
                    assert output.num_cached_tokens > 0
    assert got == {f"{rid}-{rounds}": hf_greedy(model, ids, MAX_TOKENS)
                   for rounds in range(2) for rid, ids in asked.items()}
