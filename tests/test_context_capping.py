"""max_tokens past the context: every API caps generation at what the context has left and
ends with its own length reason (agents such as Claude Code ask for 128000 tokens); a prompt
that alone fills the context is still a 400 before any stream. Driven by the official
clients on a real server whose engine stops exactly at the max_tokens it was given."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest
from fake_engine import LengthEngine
from server_helpers import running_server

CONTEXT = 300
AGENT_MAX_TOKENS = 128000
QUESTION = [{"role": "user", "content": "Tell me a long story."}]
TOO_LONG = "x" * (CONTEXT + 10)  # one token per character


@pytest.fixture(scope="module")
def server():
    engine = LengthEngine(["a"])
    engine.max_model_len = CONTEXT
    with running_server(engine) as url:
        yield url, engine


@pytest.fixture(scope="module")
def chat_client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def messages_client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server[0], api_key="x", max_retries=0)


def passed_max_tokens(engine: LengthEngine) -> int:
    return list(engine.params.values())[-1].max_tokens


def test_chat_completions_stop_at_the_context(chat_client, server):
    reply = chat_client.chat.completions.create(
        model="m", messages=QUESTION, max_tokens=AGENT_MAX_TOKENS
    )
    assert reply.choices[0].finish_reason == "length"
    usage = reply.usage
    assert usage.prompt_tokens + usage.completion_tokens == CONTEXT
    assert passed_max_tokens(server[1]) == CONTEXT - usage.prompt_tokens
    stream = chat_client.chat.completions.create(
        model="m", messages=QUESTION, max_completion_tokens=AGENT_MAX_TOKENS, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.total_tokens == CONTEXT


def test_completions_stop_at_the_context(chat_client):
    reply = chat_client.completions.create(model="m", prompt="Once", max_tokens=AGENT_MAX_TOKENS)
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.prompt_tokens == len("Once")
    assert reply.usage.completion_tokens == CONTEXT - len("Once")
    assert reply.choices[0].text == "a" * (CONTEXT - len("Once"))


def test_responses_are_incomplete_at_the_context(chat_client):
    response = chat_client.responses.create(
        model="m", input="Tell me a long story.", max_output_tokens=AGENT_MAX_TOKENS
    )
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.input_tokens + response.usage.output_tokens == CONTEXT
    with chat_client.responses.stream(
        model="m", input="Tell me a long story.", max_output_tokens=AGENT_MAX_TOKENS
    ) as stream:
        kinds = [event.type for event in stream]
    assert kinds[-1] == "response.incomplete"


def test_messages_stop_at_the_context(messages_client, server):
    # (The client refuses a non-streaming call this long; Claude Code streams.)
    with messages_client.messages.stream(
        model="m", max_tokens=AGENT_MAX_TOKENS, messages=QUESTION
    ) as stream:
        message = stream.get_final_message()
    assert message.stop_reason == "max_tokens"
    usage = message.usage
    assert usage.input_tokens + usage.output_tokens == CONTEXT
    assert message.content[0].text == "a" * usage.output_tokens
    body = {"model": "m", "max_tokens": AGENT_MAX_TOKENS, "messages": QUESTION}
    whole = httpx.post(f"{server[0]}/v1/messages", json=body, timeout=30).json()
    assert whole["stop_reason"] == "max_tokens"
    assert whole["content"] == [{"type": "text", "text": message.content[0].text}]


def test_max_tokens_within_the_context_is_kept(chat_client, server):
    reply = chat_client.completions.create(model="m", prompt="Once", max_tokens=7)
    assert reply.usage.completion_tokens == 7 and passed_max_tokens(server[1]) == 7


# (path, body, the field the OpenAI error names): each prompt alone overflows the context.
TOO_LONG_PROMPTS = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": TOO_LONG}]}, "messages"),
    ("/v1/completions", {"prompt": TOO_LONG}, "prompt"),
    ("/v1/responses", {"input": TOO_LONG}, "input"),
]


@pytest.mark.parametrize(("path", "body", "param"), TOO_LONG_PROMPTS)
def test_a_prompt_longer_than_the_context_is_a_400(server, path, body, param):
    url, engine = server
    before = len(engine.prompts)
    for stream in (False, True):
        fields = {"model": "m", "max_tokens": 4, **body, "stream": stream}
        response = httpx.post(f"{url}{path}", json=fields)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["code"] == "context_length_exceeded" and error["param"] == param
        assert str(CONTEXT) in error["message"]
    assert len(engine.prompts) == before  # refused before the engine saw it


def test_a_prompt_longer_than_the_context_is_an_anthropic_400(server, messages_client):
    url, engine = server
    before = len(engine.prompts)
    body = {"model": "m", "max_tokens": AGENT_MAX_TOKENS, "messages": [
        {"role": "user", "content": TOO_LONG}
    ]}  # fmt: skip
    with pytest.raises(anthropic.BadRequestError) as raised:
        messages_client.messages.create(stream=True, **body)
    assert raised.value.body["error"]["type"] == "invalid_request_error"
    assert str(CONTEXT) in raised.value.body["error"]["message"]
    whole = httpx.post(f"{url}/v1/messages", json=body)
    assert whole.status_code == 400 and whole.json()["type"] == "error"
    assert len(engine.prompts) == before
