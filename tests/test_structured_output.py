"""Structured output through LLMEngine: a tiny random model whose vocabulary is the default
tokenizer's (plus padding logits) still writes JSON that validates, whatever its weights."""

from __future__ import annotations

import json
import logging

import httpx
import jsonschema
import numpy as np
import openai
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
    outputs = collect_outputs(engine, requests)
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


# ---- grammars that fail: refused up front, or the request alone ends with an error -----------

# A digit, then a property whose schema admits nothing: the grammar fails only there.
FAILS_LATER = {
    "type": "object",
    "properties": {"digit": {"type": "integer", "minimum": 0, "maximum": 9},
                   "secret_field": {"$ref": "#/$defs/loop"}},
    "required": ["digit", "secret_field"],
    "$defs": {"loop": {"$ref": "#/$defs/loop"}},
}


@pytest.mark.parametrize("schema", [
    {"$ref": "#"},  # only refers to itself: no output can ever match
    {"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]},  # never ends
    pytest.param({"type": "string", "pattern": "^a{1000}{1000}$"},  # too complex to lex
                 marks=pytest.mark.slow),
])
def test_a_grammar_that_fails_in_its_first_steps_is_a_value_error_naming_the_field(
        wide_llama, default_tokenizer, schema):
    engine = make_engine(wide_llama, default_tokenizer)
    with pytest.raises(ValueError, match="response_format.*cannot be generated"):
        engine.add_request("r0", PROMPTS["r0"], structured(StructuredOutput(json.dumps(schema))))
    assert not engine.has_unfinished_requests()


def test_a_grammar_that_fails_while_generating_ends_that_request_alone_with_an_error(
        wide_llama, default_tokenizer, caplog):
    plain = {"r1": SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
             "r2": SamplingParams(max_tokens=12, seed=3, ignore_eos=True)}
    failing = {"r0": structured(StructuredOutput(json.dumps(FAILS_LATER)), temperature=0.0)}
    alone = generate(make_engine(wide_llama, default_tokenizer), plain)
    with caplog.at_level(logging.DEBUG):
        engine = make_engine(wide_llama, default_tokenizer)
        outputs = collect_outputs(engine, {**plain, **failing})
    last = outputs["r0"][-1]
    assert last.finish_reason == "error" and "NoExtensionBias" in last.error
    assert '"secret_field": ' in "".join(o.new_text for o in outputs["r0"])  # it got that far
    assert {rid: summary(outputs[rid]) for rid in plain} == alone
    assert "r0" in caplog.text and "secret_field" not in caplog.text and "$defs" not in caplog.text
    assert not engine.has_unfinished_requests() and "r0" not in engine.structured


def collect_outputs(engine: LLMEngine, requests: dict[str, SamplingParams]) -> dict:
    """Every request's outputs, in order, run to the end."""
    for rid, params in requests.items():
        engine.add_request(rid, PROMPTS[rid], params)
    outputs: dict[str, list[RequestOutput]] = {rid: [] for rid in requests}
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[output.request_id].append(output)
    return outputs


def summary(outs: list[RequestOutput]) -> tuple:
    return ([t for o in outs for t in o.new_token_ids], "".join(o.new_text for o in outs),
            outs[-1].finish_reason)


# ---- the same failures through the server, in each API's style --------------------------------


@pytest.fixture(scope="module")
def served(wide_llama, default_tokenizer):
    from server_helpers import running_server

    with running_server(make_engine(wide_llama, default_tokenizer)) as url:
        yield url


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


ASK = [{"role": "user", "content": "Answer in JSON."}]


def test_chat_refuses_a_failing_grammar_up_front_and_reports_a_late_failure(served, caplog):
    chat = f"{served}/v1/chat/completions"
    refused = httpx.post(chat, json={"messages": ASK, "max_tokens": 40,
                                     "response_format": schema_format({"$ref": "#"})})
    assert refused.status_code == 400, refused.text
    assert "response_format" in refused.json()["error"]["message"]

    body = {"messages": ASK, "max_tokens": 60, "temperature": 0,
            "response_format": schema_format(FAILS_LATER)}
    with caplog.at_level(logging.DEBUG):
        failed = httpx.post(chat, json=body, timeout=60)
    assert failed.status_code == 400, failed.text
    error = failed.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert "response_format" in error["message"] and "NoExtensionBias" in error["message"]
    assert "secret_field" not in caplog.text

    client = openai.OpenAI(base_url=f"{served}/v1", api_key="x", max_retries=0)
    stream = client.chat.completions.create(model="m", messages=ASK, max_tokens=60,
                                            temperature=0, stream=True,
                                            response_format=schema_format(FAILS_LATER))
    with pytest.raises(openai.APIError, match="response_format"):
        for _ in stream:
            pass
    # The server is fine: the next request is served.
    ok = httpx.post(f"{served}/v1/completions", json={"prompt": "Hi", "max_tokens": 3})
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"


def test_responses_and_messages_report_a_grammar_failure_in_their_style(served):
    responses = {"model": "m", "input": "Answer in JSON.", "max_output_tokens": 60,
                 "temperature": 0,
                 "text": {"format": {"type": "json_schema", "name": "x", "schema": FAILS_LATER}}}
    whole = httpx.post(f"{served}/v1/responses", json=responses, timeout=60)
    assert whole.status_code == 400 and "JSON schema" in whole.json()["error"]["message"]
    events = sse_events(httpx.post(f"{served}/v1/responses", json={**responses, "stream": True},
                                   timeout=60))
    assert events[-1]["type"] == "response.failed"
    assert "JSON schema" in events[-1]["response"]["error"]["message"]

    # A tool's schema is nested in the call's: a pattern too complex to lex fails there.
    too_complex = {"type": "string", "pattern": "^a{1000}{1000}$"}
    schema = {**FAILS_LATER, "properties": {**FAILS_LATER["properties"],
                                           "secret_field": too_complex}}
    schema.pop("$defs")
    tool = {"name": "answer", "description": "Answer.", "input_schema": schema}
    messages = {"model": "m", "max_tokens": 60, "temperature": 0, "tools": [tool],
                "tool_choice": {"type": "tool", "name": "answer"},
                "messages": [{"role": "user", "content": "Answer."}]}
    whole = httpx.post(f"{served}/v1/messages", json=messages, timeout=60)
    assert whole.status_code == 400, whole.text
    assert whole.json()["type"] == "error" and "tool" in whole.json()["error"]["message"]
    events = sse_events(httpx.post(f"{served}/v1/messages", json={**messages, "stream": True},
                                   timeout=60))
    assert events[-1]["type"] == "error"


def sse_events(response: httpx.Response) -> list[dict]:
    assert response.status_code == 200, response.text
    return [json.loads(line[len("data: "):]) for line in response.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]
