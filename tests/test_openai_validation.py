"""Request validation of the chat and completions APIs as OpenAI (and vLLM) do it, on a real
server over a scripted engine: each bad request is a 400 in OpenAI's error shape whose `param`
is the bad field's path and whose message quotes nothing the client sent at length; what
OpenAI accepts (nulls for defaults, a json_schema without a name) is accepted."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from fake_engine import ScriptedEngine
from server_helpers import running_app

from server.app import build_app
from server.async_engine import AsyncEngine

INT64_MAX = 2**63 - 1
USER = {"role": "user", "content": "hi"}
CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
ASKED = {"role": "assistant", "content": None, "tool_calls": [CALL]}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
LONG = "k" * 10_000  # a value no error message may quote whole


@pytest.fixture(scope="module")
def served():
    engine = ScriptedEngine(["ok"])
    with running_app(build_app(AsyncEngine(engine), "m")) as url:
        yield engine, url


def chat(*messages: dict, **fields) -> dict:
    return {"model": "m", "messages": list(messages or [USER]), "max_tokens": 2, **fields}


def openai_error(response: httpx.Response) -> dict:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    return error


# (body, param, text the message holds)
BAD_CHATS = [
    # integers past their documented ranges
    (chat(seed=INT64_MAX + 1), "seed", str(INT64_MAX)),
    (chat(seed=-(2**63) - 1), "seed", "greater than or equal to"),
    (chat(priority=INT64_MAX + 1), "priority", "less than or equal to"),
    (chat(max_tokens=INT64_MAX + 1), "max_tokens", "less than or equal to"),
    (chat(max_completion_tokens=INT64_MAX + 1), "max_completion_tokens", "less than"),
    (chat(top_k=INT64_MAX + 1), "top_k", "less than or equal to"),
    (chat(n=2**64), "n", "less than or equal to"),
    (chat(n=129), "n", "less than or equal to 128"),  # OpenAI's limit, whatever --max-n
    (chat(min_tokens=INT64_MAX + 1), "min_tokens", "less than or equal to"),
    (chat(min_tokens=5, max_tokens=2), "min_tokens", "at most 2 tokens"),
    # options that need streaming
    (chat(stream_options={"include_usage": True}), "stream_options", "stream: true"),
    (chat(stream=False, stream_options={}), "stream_options", "stream: true"),
    # the fields each role requires
    (chat(USER, ASKED, {"role": "tool", "content": "sunny"}), "messages[2].tool_call_id",
     "tool_call_id"),
    (chat(USER, {"role": "assistant"}), "messages[1].content", "content or tool_calls"),
    (chat(USER, {"role": "assistant", "content": None, "tool_calls": []}),
     "messages[1].content", "content or tool_calls"),
    (chat({"role": "user"}), "messages[0].content", "needs content"),
    (chat({"role": "user", "content": []}), "messages[0].content", "needs content"),
    (chat({"role": "system", "content": None}, USER), "messages[0].content", "system message"),
    (chat(USER, ASKED, {"role": "tool", "tool_call_id": "call_1"}), "messages[2].content",
     "tool message needs content"),
    (chat(USER, {"role": "function", "content": "x"}), "messages[1].name", "function's name"),
    (chat({"content": "hi"}), "messages[0].role", "Field required"),
    # nested fields are named by their path
    (chat({"role": "user", "content": [{"type": "text"}]}), "messages[0].content[0].text",
     "needs its text"),
    (chat({"role": "user", "content": [{"type": "text", "text": 5}]}),
     "messages[0].content[0].text", "valid string"),
    (chat({"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "input_audio"}]}),
     "messages[0].content[1].type", "'input_audio'"),
    (chat(USER, {**ASKED, "tool_calls": [{"id": "c", "function": {"name": "f"}}]}),
     "messages[1].tool_calls[0].function.arguments", "Field required"),
    (chat(stop=["a", 1]), "stop[1]", "valid string"),
    (chat(tool_choice={"type": "function", "function": {}}), "tool_choice.function.name",
     "Field required"),
    (chat(response_format={"type": "json_schema"}), "response_format.json_schema", "schema"),
    # logit_bias errors name the bad keys
    (chat(logit_bias={"12": 1, "word": 1, "-3": 1}), "logit_bias", "'word', '-3'"),
    (chat(logit_bias={"12": 1, "7": 150, "8": -101}), "logit_bias", "'7', '8'"),
    (chat(logit_bias={"99999999999": 1}), "logit_bias", "at most 2147483647"),
    # types of the fields OpenAI documents and we do not use
    (chat(user=5), "user", "valid string"),
    (chat(metadata={str(i): "v" for i in range(17)}), "metadata", "at most 16"),
    (chat(metadata={"k": 1}), "metadata.k", "valid string"),
    (chat(metadata={"k": "v" * 513}), "metadata.k", "at most 512"),
    (chat(metadata={"k" * 65: "v"}), "metadata", "at most 64"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "param", "contains"), BAD_CHATS)
def test_bad_chat_requests_name_the_field(served, body, param, contains):
    engine, url = served
    before = len(engine.params)
    error = openai_error(httpx.post(f"{url}/v1/chat/completions", json=body))
    assert error["param"] == param, error
    assert contains in error["message"], error
    assert len(engine.params) == before  # refused before reaching the engine


BAD_COMPLETIONS = [
    ({"suffix": "return x"}, "suffix", "fill-in-the-middle"),
    ({"prompt": [1, 2**40]}, "prompt", "2147483647"),
    ({"prompt": [[1], [-1]]}, "prompt", "[0, 2147483647]"),
    ({"seed": INT64_MAX + 1}, "seed", str(INT64_MAX)),
    ({"stream_options": {"include_usage": True}}, "stream_options", "stream: true"),
    ({"logit_bias": {"x": 1, "y": 1}}, "logit_bias", "'x', 'y'"),
    # no shape of prompt fits: the param is prompt, the message says where each went wrong
    ({"prompt": [1, "a"]}, "prompt", "prompt[1]: Input should be a valid integer"),
    ({"n": 129}, "n", "less than or equal to 128"),
    # best_of: OpenAI's range, and only what this server serves (every candidate)
    ({"best_of": 21}, "best_of", "less than or equal to 20"),
    ({"best_of": 3}, "best_of", "not supported"),
    ({"best_of": 2, "n": 3}, "best_of", "at least n"),
    ({"best_of": 0}, "best_of", "at least n"),
    # vLLM takes max_tokens 0 with echo for prompt logprobs, which this server has not
    ({"max_tokens": 0, "echo": True}, "max_tokens", "greater than or equal to 1"),
]


@pytest.mark.parametrize(("fields", "param", "contains"), BAD_COMPLETIONS)
def test_bad_completion_requests_name_the_field(served, fields, param, contains):
    _, url = served
    body = {"model": "m", "prompt": "hi", "max_tokens": 2, **fields}
    error = openai_error(httpx.post(f"{url}/v1/completions", json=body))
    assert error["param"] == param, error
    assert contains in error["message"], error


@pytest.mark.parametrize(
    "body",
    [
        chat(logit_bias={LONG: 1}),
        chat(logit_bias={"5": 1, "05": 1, **{f"{LONG}{i}": 1 for i in range(50)}}),
        chat(metadata={LONG: "v"}),
        chat({"role": "user", "content": [{"type": LONG}]}),
        chat(tool_choice={"type": "function", "function": {"name": LONG}}),
        chat(logit_bias={"5": {"deep": LONG}}),
    ],
)
def test_errors_quote_what_was_sent_only_cut_short(served, body):
    _, url = served
    error = openai_error(httpx.post(f"{url}/v1/chat/completions", json=body))
    assert LONG not in error["message"] and len(error["message"]) < 600, error
    assert error["param"] is None or len(error["param"]) < 100


# What OpenAI (or vLLM and llama-server) accept must stay accepted.
GOOD_CHATS = [
    chat(n=None, stream=None, parallel_tool_calls=None, min_tokens=None, ignore_eos=None),
    chat(seed=INT64_MAX, top_k=INT64_MAX),
    chat(seed=-(2**63)),
    chat(USER, ASKED, {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}),
    chat(USER, {"role": "assistant", "content": ""}, USER),
    chat(USER, {**ASKED, "content": []}, {"role": "tool", "tool_call_id": "call_1",
                                            "content": [{"type": "text", "text": "sunny"}]}),
    chat({"role": "developer", "content": ""}, USER),
    chat(stream_options=None),
    chat(logit_bias={"5": -100, "6": 100}, user="u", metadata={"k": "v"}),
    chat(unknown_field={"anything": [1, 2]}, service_tier="auto", store=False),
]  # fmt: skip


@pytest.mark.parametrize("body", GOOD_CHATS)
def test_what_openai_accepts_is_accepted(served, body):
    _, url = served
    response = httpx.post(f"{url}/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == "ok"


def test_nulls_mean_the_defaults_on_completions(served):
    _, url = served
    body = {"model": "m", "prompt": "hi", "n": None, "echo": None, "stream": None, "suffix": ""}
    response = httpx.post(f"{url}/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert [c["text"] for c in response.json()["choices"]] == ["ok"]


@pytest.mark.parametrize("fields", [{"best_of": 1}, {"best_of": None}, {"best_of": 2, "n": 2}])
def test_best_of_equal_to_n_returns_every_candidate(served, fields):
    _, url = served
    body = {"model": "m", "prompt": "hi", "max_tokens": 2, **fields}
    response = httpx.post(f"{url}/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert [c["text"] for c in response.json()["choices"]] == ["ok"] * fields.get("n", 1)


def test_n_goes_up_to_openais_128_when_the_server_allows_it():
    with running_app(build_app(AsyncEngine(ScriptedEngine(["ok"])), "m", max_n=128)) as url:
        body = {"model": "m", "prompt": "hi", "max_tokens": 2}
        most = httpx.post(f"{url}/v1/completions", json={**body, "n": 128})
        assert most.status_code == 200 and len(most.json()["choices"]) == 128
        more = openai_error(httpx.post(f"{url}/v1/completions", json={**body, "n": 129}))
        assert more["param"] == "n" and "128" in more["message"]


def test_max_n_past_openais_limit_is_refused_naming_the_flag(capsys):
    from server.cli import main
    from server.openai.serving import Serving

    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--max-n", "129"])
    error = capsys.readouterr().err
    assert exit_info.value.code == 2 and "--max-n" in error and "at most 128" in error
    with pytest.raises(ValueError, match="max_n"):
        Serving(AsyncEngine(ScriptedEngine(["ok"])), "m", max_n=129)


def test_json_schema_without_a_name_is_enforced(served):
    engine, url = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    reply = client.chat.completions.create(
        model="m", messages=[USER], max_tokens=2,
        response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA}},
    )  # fmt: skip
    assert reply.choices[0].message.content == "ok"
    params = list(engine.params.values())[-1]
    assert json.loads(params.structured.json_schema) == SCHEMA


def test_the_openai_client_gets_the_param(served):
    _, url = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    tool_result = {"role": "tool", "content": "sunny"}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="m", messages=[USER, ASKED, tool_result])
    assert caught.value.param == "messages[2].tool_call_id"
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="m", messages=[USER], seed=2**63)
    assert caught.value.param == "seed" and caught.value.type == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(
            model="m", prompt="hi", stream_options={"include_usage": True}
        )
    assert caught.value.param == "stream_options"


def test_stream_options_with_stream_still_stream(served):
    _, url = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    stream = client.chat.completions.create(
        model="m", messages=[USER], stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "ok"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 1
