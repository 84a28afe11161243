"""Request parsing and validation, and the OpenAI error bodies, without a model."""

from __future__ import annotations

import json

import pytest
from fake_engine import CharTokenizer
from fastapi.testclient import TestClient
from pydantic import ValidationError

from metal_engine.outputs import EngineStats, RequestOutput
from scheduler.sampling_params import StructuredOutput
from server.app import build_app
from server.async_engine import AsyncEngine
from server.core import engine_choices
from server.core.chat_request import ChatCompletionRequest
from server.openai.protocol import CompletionRequest
from server.sampling_defaults import SamplingDefaults

CONTEXT = 32
NEUTRAL = SamplingDefaults()  # the OpenAI API's own defaults
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
NAMED_F = {"type": "function", "function": {"name": "f"}}
JSON_OBJECT = {"type": "json_object"}


class CountingEngine:
    """Writes "a" once per step until max_tokens."""

    tokenizer = CharTokenizer()
    model_name = "char-model"
    max_model_len = CONTEXT

    def __init__(self) -> None:
        self.live: dict[str, list] = {}
        self.fail_at_token: int | None = None  # step raises when a request would reach it
        self.added: dict[str, tuple] = {}  # request id -> (params, priority)
        self.aborted: list[str] = []

    def add_request(self, request_id, prompt_token_ids, params, priority=0, cache_salt=None):
        self.live[request_id] = [len(prompt_token_ids), params.max_tokens, 0]
        self.added[request_id] = (params, priority)

    def abort_request(self, request_id):
        if self.live.pop(request_id, None) is not None:
            self.aborted.append(request_id)

    def stats(self) -> EngineStats:
        return EngineStats()

    def has_unfinished_requests(self):
        return bool(self.live)

    def step(self):
        outputs = []
        for rid, state in list(self.live.items()):
            if state[2] + 1 == self.fail_at_token:
                self.fail_at_token = None
                raise RuntimeError("device lost")
            state[2] += 1
            reason = "length" if state[2] == state[1] else None
            if reason:
                del self.live[rid]
            outputs.append(RequestOutput(rid, [97], "a", reason, state[0], state[2]))
        return outputs


@pytest.fixture(scope="module")
def engine():
    return CountingEngine()


@pytest.fixture(scope="module")
def client(engine):
    with TestClient(build_app(AsyncEngine(engine), "default")) as test_client:
        yield test_client


def chat(**fields):
    return {"model": "anything", "messages": [{"role": "user", "content": "hi"}], **fields}


def assert_openai_error(response, param: str | None = None, contains: str = "") -> dict:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert contains in error["message"]
    return error


# ---- parsing --------------------------------------------------------------------------------


def test_sampling_params_from_request():
    body = ChatCompletionRequest(
        **chat(temperature=0, top_p=0.5, top_k=-1, seed=3, stop="\n", ignore_eos=True)
    )
    params = body.sampling_params(5, None, NEUTRAL)
    assert (params.temperature, params.top_p, params.top_k, params.seed) == (0, 0.5, 0, 3)
    assert params.stop == ("\n",) and params.ignore_eos and params.max_tokens == 5
    two_stops = CompletionRequest(prompt="x", stop=["a", "b"])
    assert two_stops.sampling_params(1, None, NEUTRAL).stop == ("a", "b")
    assert ChatCompletionRequest(**chat()).sampling_params(1, None, NEUTRAL).temperature == 1.0


def test_sampling_params_needs_the_servers_defaults():
    # A caller that left them out would sample with neutral defaults and no one would notice.
    body = ChatCompletionRequest(**chat())
    with pytest.raises(TypeError, match="defaults"):
        body.sampling_params(5, None)
    params = body.sampling_params(5, None, SamplingDefaults(temperature=0.3, top_k=20))
    assert (params.temperature, params.top_k) == (0.3, 20)


def test_max_completion_tokens_wins_over_max_tokens():
    assert ChatCompletionRequest(**chat(max_tokens=9)).requested_max_tokens() == 9
    body = ChatCompletionRequest(**chat(max_tokens=9, max_completion_tokens=4))
    assert body.requested_max_tokens() == 4


def test_text_parts_are_joined_and_unknown_fields_ignored():
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    body = ChatCompletionRequest(
        messages=[{"role": "user", "content": parts, "name": "x"}], frequency_penalty=0, user="u"
    )
    assert body.messages[0].text() == "ab"


def test_prompt_shapes():
    assert CompletionRequest(prompt="one").prompts() == ["one"]
    assert CompletionRequest(prompt=["one", "two"]).prompts() == ["one", "two"]
    assert CompletionRequest(prompt=[1, 2, 3]).prompts() == [[1, 2, 3]]
    assert CompletionRequest(prompt=[[1, 2], [3]]).prompts() == [[1, 2], [3]]
    for empty in ("", [], [""], [[1], []]):
        with pytest.raises(ValidationError, match="must not be empty"):
            CompletionRequest(prompt=empty)
    with pytest.raises(ValidationError, match="prompt"):
        CompletionRequest(prompt=[1, "two"])


def test_new_sampling_fields_reach_the_engine():
    body = ChatCompletionRequest(**chat(
        presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2, min_p=0.1,
        min_tokens=2, logprobs=True, top_logprobs=3,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}},
    ))  # fmt: skip
    params = body.sampling_params(5, body.response_structure(), NEUTRAL)
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -0.5)
    assert (params.repetition_penalty, params.min_p, params.min_tokens) == (1.2, 0.1, 2)
    assert params.logprobs == 3
    assert json.loads(params.structured.json_schema) == SCHEMA
    plain = ChatCompletionRequest(**chat()).sampling_params(5, None, NEUTRAL)
    assert (plain.logprobs, plain.structured, plain.repetition_penalty) == (None, None, 1.0)
    with_logprobs = ChatCompletionRequest(**chat(logprobs=True))
    assert with_logprobs.sampling_params(5, None, NEUTRAL).logprobs == 0
    json_object = ChatCompletionRequest(**chat(response_format={"type": "json_object"}))
    assert json_object.response_structure() == StructuredOutput(json_schema=None)
    assert CompletionRequest(prompt="x", logprobs=2).sampling_params(5, None, NEUTRAL).logprobs == 2


# ---- error bodies ---------------------------------------------------------------------------


def test_malformed_json(client):
    headers = {"content-type": "application/json"}
    response = client.post("/v1/chat/completions", content=b'{"messages": [', headers=headers)
    assert_openai_error(response, contains="not valid JSON")


@pytest.mark.parametrize(
    ("body", "param", "contains"),
    [
        ({"model": "m"}, "messages", "messages: Field required"),
        ({"messages": []}, "messages", "at least one message"),
        (chat(max_tokens=0), "max_tokens", "greater than or equal to 1"),
        (chat(max_tokens=-1), "max_tokens", "max_tokens"),
        (chat(max_completion_tokens=0), "max_completion_tokens", "greater than or equal to 1"),
        (chat(temperature=-0.5), "temperature", "temperature"),
        (chat(temperature=7), "temperature", "less than or equal to 2"),
        (chat(top_p=0), "top_p", "top_p"),
        (chat(n=0), "n", "greater than or equal to 1"),
        (chat(n=17), "n", "at most 16 choices"),
        (chat(top_logprobs=2), "top_logprobs", "logprobs: true"),
        (chat(logprobs=True, top_logprobs=21), "top_logprobs", "20"),
        (chat(presence_penalty=2.5), "presence_penalty", "less than or equal to 2"),
        (chat(frequency_penalty=-3), "frequency_penalty", "greater than or equal to -2"),
        (chat(repetition_penalty=0), "repetition_penalty", "greater than 0"),
        (chat(min_p=1.5), "min_p", "less than or equal to 1"),
        (chat(min_tokens=-1), "min_tokens", "greater than or equal to 0"),
        (chat(stop=["x"] * 17), "stop", "16"),
        (chat(response_format={"type": "xml"}), "response_format.type", "json_schema"),
        (chat(response_format={"type": "json_schema"}), "response_format.json_schema", "schema"),
        (chat(tool_choice="required"), "tool_choice", "needs tools"),
        (chat(tools=[WEATHER_TOOL], tool_choice=NAMED_F), "tool_choice", "'f'"),
        (chat(tools=[WEATHER_TOOL], tool_choice="required", response_format=JSON_OBJECT),
         "response_format", "tool_choice"),
        (chat(tools=[{"type": "function", "function": {"name": "bad name"}}]),
         "tools[0].function.name", "pattern"),
        (chat(tools=[WEATHER_TOOL] * 513), "tools", "at most 512"),
        (chat(max_tokens="many"), "max_tokens", "valid integer"),
        (chat(logit_bias={"word": 1}), "logit_bias", "token ids"),
        (chat(logit_bias={"5": 150}), "logit_bias", "[-100, 100]"),
        (chat(logit_bias={"99999": 1}), "logit_bias", "99999"),
        (chat(logit_bias={"5": 60, "05": 60}), "logit_bias", "token 5 is named twice"),
        (chat(logit_bias={str(i): 1 for i in range(1025)}), "logit_bias", "at most 1024"),
    ],
)
def test_invalid_chat_requests(client, body, param, contains):
    assert_openai_error(client.post("/v1/chat/completions", json=body), param, contains)


def test_image_parts_are_refused_by_a_model_without_vision(client):
    image = {"type": "image_url", "image_url": {"url": "http://x"}}
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "See:"}, image]}]}
    response = client.post("/v1/chat/completions", json=body)
    assert_openai_error(response, "messages[0].content[1].image_url", "reads text only")
    # In an assistant message an image is wrong for any model.
    body = {"messages": [{"role": "assistant", "content": [image]}]}
    response = client.post("/v1/chat/completions", json=body)
    assert_openai_error(response, "messages[0].content[0].type", "images go in user messages")


def test_prompt_longer_than_context(client):
    error = assert_openai_error(
        client.post("/v1/completions", json={"prompt": "x" * 40}), "prompt", "40 tokens"
    )
    assert str(CONTEXT) in error["message"] and error["code"] == "context_length_exceeded"
    long_chat = chat(messages=[{"role": "user", "content": "y" * 40}])
    assert_openai_error(client.post("/v1/chat/completions", json=long_chat), "messages")


def test_max_tokens_past_the_context_is_capped(client):
    body = {"prompt": "x" * 10, "max_tokens": 30}
    reply = client.post("/v1/completions", json=body).json()
    assert reply["choices"][0]["finish_reason"] == "length"
    assert reply["usage"]["completion_tokens"] == CONTEXT - 10


def test_out_of_vocab_token_ids(client):
    body = {"prompt": [1, 999]}
    assert_openai_error(client.post("/v1/completions", json=body), "prompt", "999")


def test_unknown_route_uses_the_error_body(client):
    response = client.get("/v1/nothing")
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "not_found_error"


def test_engine_failure_is_a_500_and_the_server_keeps_serving(client, engine):
    engine.fail_at_token = 1
    response = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == "server_error" and "the server log has the details" in error["message"]
    assert "device lost" not in response.text  # the engine's text may quote the prompt

    engine.fail_at_token = 2  # after the first delta went out: an error event ends the stream
    body = {"prompt": "hi", "max_tokens": 3, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert json.loads(events[0])["choices"][0]["text"] == "a"
    assert "server log" in json.loads(events[1])["error"]["message"]
    assert "device lost" not in events[1]
    assert events[2:] == ["[DONE]"]

    response = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
    assert response.json()["choices"][0]["text"] == "aaa"


# ---- response shapes ------------------------------------------------------------------------


def test_chat_response_shape(client):
    response = client.post("/v1/chat/completions", json=chat(max_tokens=3))
    body = response.json()
    assert body["object"] == "chat.completion" and body["model"] == "default"
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "aaa"},
            "finish_reason": "length",
            "logprobs": None,
        }
    ]
    prompt_len = len("user: hi\nassistant: ")
    assert body["usage"] == {
        "prompt_tokens": prompt_len,
        "completion_tokens": 3,
        "total_tokens": prompt_len + 3,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_chat_stream_shape(client):
    body = chat(max_tokens=2, stream=True, stream_options={"include_usage": True})
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert [c["choices"][0]["delta"]["content"] for c in chunks[1:-1]] == ["a", "a"]
    assert [c["choices"][0]["finish_reason"] for c in chunks[1:-1]] == [None, "length"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 2


def test_completion_stream_shape(client):
    with client.stream(
        "POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream": True}
    ) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["choices"][0]["text"] for c in chunks] == ["a", "a"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["object"] == "text_completion" and c["usage"] is None for c in chunks)


def test_models_and_health(client):
    ids = [m["id"] for m in client.get("/v1/models").json()["data"]]
    assert ids == ["default", "char-model"]
    assert client.get("/health").json() == {"status": "ok"}


# ---- several choices ------------------------------------------------------------------------


def test_n_choices_are_indexed_and_usage_counts_the_prompt_once(client):
    body = chat(max_tokens=2, n=3)
    response = client.post("/v1/chat/completions", json=body).json()
    assert [(c["index"], c["message"]["content"]) for c in response["choices"]] == [
        (0, "aa"), (1, "aa"), (2, "aa")
    ]
    prompt_len = len("user: hi\nassistant: ")
    assert response["usage"]["prompt_tokens"] == prompt_len
    assert response["usage"]["completion_tokens"] == 3 * 2
    body = {"prompt": "hi", "max_tokens": 4, "n": 2}
    response = client.post("/v1/completions", json=body).json()
    assert [(c["index"], c["text"]) for c in response["choices"]] == [(0, "aaaa"), (1, "aaaa")]
    assert response["usage"]["total_tokens"] == 2 + 2 * 4


def test_n_choices_stream_each_with_its_index(client):
    body = chat(max_tokens=2, n=2, stream=True, stream_options={"include_usage": True})
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    *chunks, usage = [json.loads(e) for e in events[:-1]]
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert [c["delta"]["content"] for c in mine[1:]] == ["a", "a"]
        assert [c["finish_reason"] for c in mine[1:]] == [None, "length"]
    assert all(len(c["choices"]) == 1 for c in chunks)
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4


def test_choices_get_derived_seeds_and_the_request_priority(client, engine):
    body = {"prompt": "hi", "n": 3, "seed": 40, "max_tokens": 1, "priority": 2}
    request_id = client.post("/v1/completions", json=body).json()["id"]
    added = [engine.added[f"{request_id}-{i}"] for i in range(3)]
    assert [params.seed for params, _ in added] == [40, 41, 42]
    assert [priority for _, priority in added] == [2, 2, 2]


def test_usage_of_several_choices():
    lasts = [RequestOutput("a", [], "", "length", 10, 3, num_cached_tokens=8),
             RequestOutput("b", [], "", "stop", 10, 5, num_cached_tokens=0)]
    usage = engine_choices.usage_of(lasts, n=2)
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (10, 8, 18)
    assert usage.prompt_tokens_details.cached_tokens == 0
    # Two prompts of one choice each: both prompts count, and both cache hits.
    usage = engine_choices.usage_of(lasts, n=1)
    assert (usage.prompt_tokens, usage.completion_tokens) == (20, 8)
    assert usage.prompt_tokens_details.cached_tokens == 8


# ---- completions: batches, echo, token ids --------------------------------------------------


def test_a_batch_of_prompts_numbers_choices_by_prompt(client, engine):
    body = {"prompt": ["ab", "cde"], "n": 2, "max_tokens": 2, "seed": 5}
    response = client.post("/v1/completions", json=body).json()
    assert [(c["index"], c["text"]) for c in response["choices"]] == [
        (0, "aa"), (1, "aa"), (2, "aa"), (3, "aa")
    ]
    assert response["usage"]["prompt_tokens"] == 2 + 3
    assert response["usage"]["completion_tokens"] == 4 * 2
    request_id = response["id"]
    added = [engine.added[f"{request_id}-{k}"][0] for k in range(4)]
    assert [params.seed for params in added] == [5, 6, 5, 6]  # choice i of each prompt
    token_ids = {"prompt": [[104, 105], [106]], "max_tokens": 1}
    response = client.post("/v1/completions", json=token_ids).json()
    assert response["usage"]["prompt_tokens"] == 3 and len(response["choices"]) == 2


def test_echo_puts_the_prompt_before_the_completion(client):
    body = {"prompt": "hi", "max_tokens": 2, "echo": True}
    assert client.post("/v1/completions", json=body).json()["choices"][0]["text"] == "hiaa"
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    texts = [json.loads(e)["choices"][0]["text"] for e in events[:-1]]
    assert texts == ["hia", "a"]


@pytest.mark.parametrize(
    ("body", "param", "contains"),
    [
        ({"prompt": "hi", "echo": True, "logprobs": 1}, "echo", "prompt's logprobs"),
        ({"prompt": "hi", "logprobs": 21}, "logprobs", "20"),
        ({"prompt": ["a", "b"], "n": 9}, "n", "for each of 2 prompts"),
        ({"prompt": [[1], [999]]}, "prompt", "999"),
        ({"prompt": [[]]}, "prompt", "must not be empty"),
        ({"prompt": "hi", "stop": ["x"] * 17}, "stop", "16"),
    ],
)
def test_invalid_completion_requests(client, body, param, contains):
    assert_openai_error(client.post("/v1/completions", json=body), param, contains)
