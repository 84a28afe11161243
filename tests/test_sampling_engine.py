"""Penalties, min_tokens and logprobs through LLMEngine on a tiny random Llama, against
PyTorch logits with the penalties applied in numpy; synchronous and async scheduling alike."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_helpers import make_runner_and_scheduler
from test_sampler import penalized_reference

from metal_engine.engine import LLMEngine
from metal_engine.outputs import RequestOutput
from metal_engine.sampling.sampling_row import SamplingRow
from scheduler import SamplingParams

RNG = np.random.default_rng(8)
PROMPTS = {f"r{i}": [int(t) for t in RNG.integers(3, 128, size=n)]
           for i, n in enumerate((6, 30, 11))}
GREEDY = dict(max_tokens=10, temperature=0.0, ignore_eos=True)


def generate(path, tokenizer, requests: dict[str, SamplingParams],
             async_scheduling: bool = False) -> dict[str, list[RequestOutput]]:
    # A small budget puts prefill chunks and decodes into the same steps.
    runner, scheduler = make_runner_and_scheduler(path, block_size=8, max_num_batched_tokens=24)
    engine = LLMEngine(runner, scheduler, tokenizer, "tiny", async_scheduling=async_scheduling)
    for rid, params in requests.items():
        engine.add_request(rid, PROMPTS[rid], params)
    outputs = {rid: [] for rid in requests}
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[output.request_id].append(output)
    return outputs


def tokens(outputs: list[RequestOutput]) -> list[int]:
    return [t for o in outputs for t in o.new_token_ids]


def torch_log_softmax(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1).numpy()


def reference_greedy(model, prompt: list[int], params: SamplingParams) -> list[int]:
    """Greedy decoding one token at a time on PyTorch's logits, penalized in numpy."""
    outputs = []
    for _ in range(params.max_tokens):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + outputs])).logits[0, -1].numpy()
        row = SamplingRow(params, len(outputs), prompt, outputs)
        outputs.append(int(np.argmax(penalized_reference(logits, row))))
    return outputs


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_penalized_greedy_matches_a_reference_loop(tiny_llama, default_tokenizer,
                                                   async_scheduling):
    model, path = tiny_llama
    requests = {
        "r0": SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, **GREEDY),
        "r1": SamplingParams(presence_penalty=1.5, **GREEDY),
        "r2": SamplingParams(**GREEDY),  # a plain row next to them
    }
    got = generate(path, default_tokenizer, requests, async_scheduling)
    for rid, params in requests.items():
        assert tokens(got[rid]) == reference_greedy(model, PROMPTS[rid], params), rid
    unpenalized = reference_greedy(model, PROMPTS["r0"], SamplingParams(**GREEDY))
    assert tokens(got["r0"]) != unpenalized  # the penalties did change the choice


def test_min_tokens_holds_back_eos(tiny_llama, default_tokenizer):
    eos = 2  # the tiny Llama's; a bias makes it every step's favourite
    params = SamplingParams(max_tokens=10, temperature=0.0, min_tokens=3,
                            logit_bias=((eos, 100.0),))
    (got,) = generate(tiny_llama[1], default_tokenizer, {"r0": params}).values()
    ids = tokens(got)
    assert eos not in ids[:3] and ids[3:] == [eos]
    assert got[-1].finish_reason == "stop"


def test_logprobs_are_the_models_raw_log_softmax(tiny_llama, default_tokenizer):
    model, path = tiny_llama
    requests = {
        "r0": SamplingParams(max_tokens=6, temperature=0.8, seed=1, ignore_eos=True,
                             presence_penalty=1.0, logprobs=3),
        "r1": SamplingParams(max_tokens=6, ignore_eos=True),
    }
    got = generate(path, default_tokenizer, requests)
    assert all(o.logprobs is None for o in got["r1"])
    ids, logprobs = tokens(got["r0"]), [lp for o in got["r0"] for lp in o.logprobs]
    assert [lp.token_id for lp in logprobs] == ids
    prompt = PROMPTS["r0"]
    reference = torch_log_softmax(model, prompt + ids)[len(prompt) - 1 : -1]
    for lp, token, row in zip(logprobs, ids, reference, strict=True):
        assert lp.logprob == pytest.approx(row[token], abs=1e-4)
        best = np.argsort(-row)[:3].tolist()
        assert [t for t, _ in lp.top] == best
        np.testing.assert_allclose([v for _, v in lp.top], row[best], atol=1e-4)
