"""Async scheduling: step N+1 is scheduled and queued before step N's tokens are known.

Whatever the pipeline does, every request must come out exactly as with synchronous steps:
same tokens, texts, finish reasons and counts — through chunked prefill, preemption, stops on
a token id, on a stop string and on length, and seeded sampling.
"""

from __future__ import annotations

import numpy as np
import pytest
from engine_helpers import make_runner_and_scheduler

from metal_engine.engine import LLMEngine
from scheduler import Request, SamplingParams
from scheduler.request import PENDING_TOKEN

RNG = np.random.default_rng(5)
PROMPTS = {f"r{i}": [int(t) for t in RNG.integers(3, 128, size=n)]
           for i, n in enumerate((5, 13, 40, 22, 9, 31))}


def run(path, tokenizer, requests: dict[str, SamplingParams], async_scheduling: bool,
        num_blocks: int = 64):
    """Every request's (token ids, text, finish reason, output count); per step, whether it
    fed a token still being sampled; and how many preemptions there were."""
    runner, scheduler = make_runner_and_scheduler(
        path, num_blocks=num_blocks, block_size=8, max_num_batched_tokens=24
    )
    engine = LLMEngine(runner, scheduler, tokenizer, "tiny", async_scheduling=async_scheduling)
    fed_pending = []
    launch = runner.launch

    def spy(out, previous=None, context=None):
        fed_pending.append(any(PENDING_TOKEN in s.token_ids for s in out.scheduled))
        return launch(out, previous, context)

    runner.launch = spy
    for rid, params in requests.items():
        engine.add_request(rid, PROMPTS[rid], params)
    results = {rid: ([], "", None, 0) for rid in requests}
    while engine.has_unfinished_requests():
        for o in engine.step():
            ids, text, _, _ = results[o.request_id]
            results[o.request_id] = (ids + o.new_token_ids, text + o.new_text, o.finish_reason,
                                     o.num_output_tokens)
    assert scheduler.pool.num_free_blocks == num_blocks
    if scheduler.group("states") is not None:
        assert scheduler.group("states").num_free_slots == scheduler.config.num_state_slots
    if scheduler.group("window") is not None:  # all back but the null block
        assert scheduler.group("window").num_free_blocks == scheduler.config.num_window_blocks - 1
    return results, fed_pending, scheduler.num_preemptions


@pytest.fixture(scope="module")
def greedy(tiny_llama, default_tokenizer):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    return run(tiny_llama[1], default_tokenizer, {rid: params for rid in PROMPTS}, False)[0]


def mixed_requests(greedy) -> dict[str, SamplingParams]:
    """One of each way to stop, with stop values taken from the greedy run so they do hit."""
    g = dict(temperature=0.0, ignore_eos=True)
    r1_ids, r3_text = greedy["r1"][0], greedy["r3"][1]
    return {
        "r0": SamplingParams(max_tokens=7, **g),
        "r1": SamplingParams(max_tokens=12, stop_token_ids=(r1_ids[4],), **g),
        "r2": SamplingParams(max_tokens=10, temperature=0.9, seed=3, ignore_eos=True),
        "r3": SamplingParams(max_tokens=12, stop=(r3_text[len(r3_text) // 2:][:2],), **g),
        "r4": SamplingParams(max_tokens=1, **g),
        "r5": SamplingParams(max_tokens=12, **g),
    }


def test_async_steps_give_exactly_the_synchronous_results(tiny_llama, default_tokenizer,
                                                          greedy):
    requests = mixed_requests(greedy)
    sync, _, _ = run(tiny_llama[1], default_tokenizer, requests, async_scheduling=False)
    pipelined, fed_pending, _ = run(tiny_llama[1], default_tokenizer, requests,
                                    async_scheduling=True)
    assert pipelined == sync
    assert any(fed_pending)  # the pipeline did feed tokens before they were known
    assert sync["r1"][2] == "stop" and len(sync["r1"][0]) <= 5
    assert sync["r3"][2] == "stop" and len(sync["r3"][0]) < 12
    assert sync["r0"][2:] == ("length", 7) and sync["r4"][2:] == ("length", 1)


def test_async_steps_survive_preemption(tiny_llama, default_tokenizer, greedy):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    requests = {rid: params for rid in PROMPTS}
    # 12 blocks of 8 tokens cannot hold the six requests (~17 blocks) at once.
    pipelined, fed_pending, preemptions = run(tiny_llama[1], default_tokenizer, requests,
                                              async_scheduling=True, num_blocks=12)
    assert pipelined == greedy and any(fed_pending) and preemptions > 0


def test_a_pending_token_without_a_step_in_flight_is_an_error(tiny_llama):
    runner, scheduler = make_runner_and_scheduler(tiny_llama[1], block_size=8)
    scheduler.add_request(Request("a", [3, 4, 5], SamplingParams(max_tokens=4)))
    out = scheduler.schedule()
    out.scheduled[0].token_ids[-1] = PENDING_TOKEN
    with pytest.raises(RuntimeError, match="pending"):
        runner.launch(out)


def test_an_abort_mid_pipeline_counts_only_the_tokens_delivered(tiny_llama, default_tokenizer):
    runner, scheduler = make_runner_and_scheduler(tiny_llama[1], block_size=8)
    engine = LLMEngine(runner, scheduler, default_tokenizer, "tiny", async_scheduling=True)
    engine.add_request("a", PROMPTS["r1"], SamplingParams(max_tokens=50, ignore_eos=True))
    delivered = []
    while len(delivered) < 3:
        delivered += [t for o in engine.step() for t in o.new_token_ids]
    engine.abort_request("a")  # a fourth token is being sampled right now
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [(o.finish_reason, o.num_output_tokens) for o in outputs] == [("abort", 3)]
    assert scheduler.pool.num_free_blocks == 64


@pytest.fixture(scope="module")
def tiny_windowed(tmp_path_factory):
    """A tiny Gemma 3: windowed layers (window 8) beside a full one."""
    from tiny_models import build_tiny_model

    from convert import convert_model

    source = tmp_path_factory.mktemp("gemma3-hf")
    build_tiny_model("gemma3_text", source)
    return convert_model(source, tmp_path_factory.mktemp("gemma3") / "model", progress=False)


@pytest.fixture(scope="module")
def tiny_sparse(tmp_path_factory):
    """A tiny DeepSeek V3.2: latent rows with index keys, each query choosing its top 8."""
    from tiny_models import build_tiny_model

    from convert import convert_model

    source = tmp_path_factory.mktemp("deepseek_v32-hf")
    build_tiny_model("deepseek_v32", source)
    return convert_model(source, tmp_path_factory.mktemp("deepseek_v32") / "model",
                         progress=False)


@pytest.mark.parametrize("model", ["tiny_hybrid", "tiny_windowed", "tiny_deepseek",
                                   "tiny_sparse"])
def test_async_steps_keep_every_cache_group_right(model, request, default_tokenizer):
    """Recurrent-state slots and checkpoints, window blocks freed behind each request, and
    latent blocks (with index keys past index_topk), under the pipeline and preemption: the
    synchronous tokens, exactly."""
    path = request.getfixturevalue(model)
    path = path[1] if isinstance(path, tuple) else path
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    requests = {rid: params for rid in PROMPTS}
    sync, _, _ = run(path, default_tokenizer, requests, async_scheduling=False)
    pipelined, fed_pending, preemptions = run(path, default_tokenizer, requests,
                                              async_scheduling=True, num_blocks=12)
    assert pipelined == sync and any(fed_pending) and preemptions > 0
