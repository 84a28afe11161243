"""A hybrid model (Qwen3.5: Gated DeltaNet layers beside full attention) through the scheduler
and the engine: linear-attention state lives in per-request slots, freed when a request ends
and reset when a preempted request starts over, so every request's greedy tokens equal
`transformers.generate` of its prompt alone."""

from __future__ import annotations

import logging
import shutil

import numpy as np
import pytest
import torch
from engine_helpers import make_runner_and_scheduler
from tiny_models import VOCAB, build_tiny_model

from convert import convert_model
from metal_engine.config import EngineConfig
from metal_engine.engine import LLMEngine
from scheduler import Request, SamplingParams

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """(torch model, converted model dir) of a tiny Qwen3.5."""
    source = tmp_path_factory.mktemp("qwen3_5-hf")
    model = build_tiny_model("qwen3_5_text", source)
    return model, convert_model(source, tmp_path_factory.mktemp("qwen3_5") / "model",
                                progress=False)


def prompts(count: int) -> dict[str, list[int]]:
    rng = np.random.default_rng(5)
    return {f"r{i}": [int(t) for t in rng.integers(3, VOCAB, size=17 + 3 * i)]
            for i in range(count)}  # fmt: skip


def hf_greedy(model, ids: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                             pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_preempted_and_finished_requests_leave_their_slots_right(hybrid):
    model, path = hybrid
    asked = prompts(6)
    # Each request needs up to 5 blocks of 8; together they need ~28 and the pool has 12, and
    # 6 requests share 4 state slots.
    runner, scheduler = make_runner_and_scheduler(path, num_blocks=12, block_size=8,
                                                  max_num_seqs=4, max_model_len=96)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    requests = [Request(rid, ids, params, eos_token_ids=(2,)) for rid, ids in asked.items()]
    for request in requests:
        scheduler.add_request(request)
    preemptions = 0
    while scheduler.has_unfinished_requests():
        running_before = set(scheduler.running)
        out = scheduler.schedule()
        preemptions += len(running_before - set(scheduler.running))
        scheduler.update(out, runner.execute(out))
        runner.release(out.finished_ids)
    assert preemptions > 0
    for request in requests:
        assert request.output_token_ids == hf_greedy(model, asked[request.request_id])
    assert runner.cache.states.num_slots == 4  # released slots were reused, none added


def test_the_engine_serves_a_hybrid_model_without_prefix_caching(hybrid, default_tokenizer,
                                                                 tmp_path, caplog):
    model, path = hybrid
    served = tmp_path / "model"
    shutil.copytree(path, served)
    default_tokenizer.save_pretrained(served)
    with caplog.at_level(logging.INFO, logger="metal_engine.engine"):
        engine = LLMEngine.from_config(EngineConfig(model_dir=served, dtype="float32",
                                                    max_num_seqs=4, kv_cache_memory=1 << 22))
    assert not engine.scheduler.config.enable_prefix_caching
    assert "prefix caching is off" in caplog.text
    asked = prompts(3)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    for rid, ids in asked.items():
        engine.add_request(rid, ids, params)
    got: dict[str, list[int]] = {rid: [] for rid in asked}
    while engine.has_unfinished_requests():
        for output in engine.step():
            got[output.request_id] += output.new_token_ids
    assert got == {rid: hf_greedy(model, ids) for rid, ids in asked.items()}
