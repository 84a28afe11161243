"""Structured output through LLMEngine: a tiny random model whose vocabulary is the default
tokenizer's (plus padding logits) still writes JSON that validates, whatever its weights."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
import torch
from conftest import TINY_LLAMA
from engine_helpers import make_runner_and_scheduler
from transformers import LlamaConfig, LlamaForCausalLM

from metal_engine.engine import LLMEngine
from metal_engine.outputs import RequestOutput
from scheduler import SamplingParams
from scheduler.sampling_params import StructuredOutput

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "count": {"type": "integer", "minimum": 0, "maximum": 500},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 3},
    },
    "required": ["name", "count", "ok", "tags"],
    "additionalProperties": False,
}
STRUCTURED = StructuredOutput(json.dumps(SCHEMA))
RNG = np.random.default_rng(9)
PROMPTS = {f"r{i}": [int(t) for t in RNG.integers(3, 40000, size=n)]
           for i, n in enumerate((7, 29, 12, 18, 5))}


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory, default_tokenizer):
    """A tiny random Llama over the default tokenizer, with 64 logits past its vocabulary."""
    torch.manual_seed(0)
    config = LlamaConfig(**{**TINY_LLAMA, "vocab_size": len(default_tokenizer) + 64,
                            "hidden_size": 48, "num_attention_heads": 3,
                            "num_key_value_heads": 1})
    path = tmp_path_factory.mktemp("wide-llama")
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    return path


def make_engine(path, tokenizer, async_scheduling: bool = False) -> LLMEngine:
    runner, scheduler = make_runner_and_scheduler(path, block_size=8, max_num_batched_tokens=32)
    return LLMEngine(runner, scheduler, tokenizer, "tiny", async_scheduling=async_scheduling)


def generate(engine: LLMEngine, requests: dict[str, SamplingParams]) -> dict[str, tuple]:
    """Every request's (token ids, text, finish reason)."""
    for rid, params in requests.items():
        engine.add_request(rid, PROMPTS[rid], params)
    outputs: dict[str, list[RequestOutput]] = {rid: [] for rid in requests}
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[output.request_id].append(output)
    return {
        rid: ([t for o in outs for t in o.new_token_ids], "".join(o.new_text for o in outs),
              outs[-1].finish_reason)
        for rid, outs in outputs.items()
    }


def structured(schema: StructuredOutput = STRUCTURED, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=150, structured=schema, **kwargs)


def test_json_schema_output_parses_and_validates(wide_llama, default_tokenizer):
    requests = {"r0": structured(temperature=0.0), "r1": structured(seed=5),
                "r2": structured(seed=6, repetition_penalty=1.2, min_p=0.05)}
    got = generate(make_engine(wide_llama, default_tokenizer), requests)
    for rid, (_, text, reason) in got.items():
        assert reason == "stop", rid  # the grammar completed, well before max_tokens
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len({text for _, text, _ in got.values()}) > 1


def test_unconstrained_random_model_does_not_write_json(wide_llama, default_tokenizer):
    # Without the grammar the same model's text is no JSON: the grammar is what made it so.
    got = generate(make_engine(wide_llama, default_tokenizer),
                   {"r0": SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)})
    with pytest.raises(ValueError):
        json.loads(got["r0"][1])


@pytest.mark.parametrize(("feature", "schema"), [
    ("uniqueItems", {"type": "array", "items": {"type": "string"}, "uniqueItems": True}),
    ("contains", {"type": "array", "items": {"type": "integer"}, "contains": {"const": 1}}),
])
def test_unsupported_schema_features_are_a_value_error_naming_them(
        wide_llama, default_tokenizer, feature, schema):
    engine = make_engine(wide_llama, default_tokenizer)
    with pytest.raises(ValueError, match=feature):
        engine.add_request("r0", PROMPTS["r0"],
                           structured(StructuredOutput(json.dumps(schema))))
    assert not engine.has_unfinished_requests()


def test_a_schema_that_is_not_json_is_a_value_error(wide_llama, default_tokenizer):
    engine = make_engine(wide_llama, default_tokenizer)
    with pytest.raises(ValueError, match="JSON"):
        engine.add_request("r0", PROMPTS["r0"], structured(StructuredOutput("{not json")))


def test_greedy_grammar_output_is_the_same_with_async_scheduling(wide_llama,
                                                                 default_tokenizer):
    requests = {"r0": structured(temperature=0.0), "r1": structured(temperature=0.0),
                "r2": SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)}
    sync = generate(make_engine(wide_llama, default_tokenizer), requests)
    pipelined = generate(make_engine(wide_llama, default_tokenizer, async_scheduling=True),
                         requests)
    assert pipelined == sync
    assert sync["r0"][2] == "stop"


def test_plain_rows_are_untouched_by_structured_and_penalized_neighbours(wide_llama,
                                                                         default_tokenizer):
    plain = {"r0": SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
             "r1": SamplingParams(max_tokens=12, seed=3, ignore_eos=True)}
    neighbours = {"r2": structured(temperature=0.0),
                  "r3": SamplingParams(max_tokens=12, frequency_penalty=2.0, min_p=0.1,
                                       logprobs=5, seed=4),
                  "r4": structured(seed=7, presence_penalty=-1.0, min_tokens=2)}
    alone = generate(make_engine(wide_llama, default_tokenizer), plain)
    mixed = generate(make_engine(wide_llama, default_tokenizer), {**plain, **neighbours})
    assert {rid: mixed[rid] for rid in plain} == alone
