"""Structured output, logprobs, stop strings, seeds and completions prompts on the default
model, through the official client against a real server."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest
from server_helpers import small_engine

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 512
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
ASK_PERSON = [{"role": "user", "content": "Describe a famous scientist as JSON."}]
QUESTION = [{"role": "user", "content": "Write one sentence about the sea."}]


@pytest.fixture(scope="module")
def engine(default_model_dir):
    return small_engine(default_model_dir, MAX_MODEL_LEN)


def person_format() -> dict:
    json_schema = {"name": "person", "schema": PERSON, "strict": True}
    return {"type": "json_schema", "json_schema": json_schema}


# ---- structured output ----------------------------------------------------------------------


def test_json_schema_output_validates(client):
    reply = client.chat.completions.create(
        model="default", messages=ASK_PERSON, response_format=person_format(), temperature=0,
        max_tokens=80,
    )  # fmt: skip
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)

    stream = client.chat.completions.create(
        model="default", messages=ASK_PERSON, response_format=person_format(), temperature=0.8,
        seed=1, max_tokens=80, stream=True,
    )  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), PERSON)


def test_json_object_output_is_an_object(client):
    messages = [{"role": "user", "content": "Give the capital of France as JSON."}]
    reply = client.chat.completions.create(
        model="default", messages=messages, response_format={"type": "json_object"},
        temperature=0, max_tokens=100,
    )  # fmt: skip
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


def test_an_unsupported_schema_feature_is_a_400(base_url):
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    response_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    body = {"messages": ASK_PERSON, "response_format": response_format}
    response = httpx.post(f"{base_url}/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    assert "uniqueItems" in response.json()["error"]["message"]


# ---- logprobs -------------------------------------------------------------------------------


def assert_consistent(content: str, logprobs, top: int) -> None:
    """Tokens join to the text; each top list is sorted and, greedy, led by the token (the
    last token may be cut short by a stop string; its alternative keeps the whole text)."""
    assert "".join(t.token for t in logprobs) == content
    for i, t in enumerate(logprobs):
        assert t.bytes == list(t.token.encode())
        assert len(t.top_logprobs) == top
        values = [alt.logprob for alt in t.top_logprobs]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        leader = t.top_logprobs[0]
        assert leader.logprob == t.logprob
        last = i == len(logprobs) - 1
        assert leader.token == t.token or (last and leader.token.startswith(t.token))


def test_chat_logprobs_match_the_text(client):
    reply = client.chat.completions.create(
        model="default", messages=QUESTION, temperature=0, max_tokens=16, logprobs=True,
        top_logprobs=5,
    )  # fmt: skip
    choice = reply.choices[0]
    assert len(choice.logprobs.content) == reply.usage.completion_tokens - (
        choice.finish_reason == "stop"  # EOS has no text and no entry
    )
    assert_consistent(choice.message.content, choice.logprobs.content, top=5)

    stream = client.chat.completions.create(
        model="default", messages=QUESTION, temperature=0, max_tokens=16, logprobs=True,
        top_logprobs=5, stream=True,
    )  # fmt: skip
    chunks = [c for c in stream if c.choices]
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    entries = [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert content == choice.message.content
    assert_consistent(content, entries, top=5)


def test_stop_strings_cut_the_text_and_its_logprobs(client):
    full = (
        client.chat.completions.create(
            model="default", messages=QUESTION, temperature=0, max_tokens=24
        )
        .choices[0]
        .message.content
    )
    stop = full.split()[3]  # a word in the middle: it may span tokens
    expected = full[: full.index(stop)]
    reply = client.chat.completions.create(
        model="default", messages=QUESTION, temperature=0, max_tokens=24, stop=[stop, "\u2603"],
        logprobs=True, top_logprobs=1,
    )  # fmt: skip
    choice = reply.choices[0]
    assert (choice.message.content, choice.finish_reason) == (expected, "stop")
    assert_consistent(expected, choice.logprobs.content, top=1)
    stream = client.chat.completions.create(
        model="default", messages=QUESTION, temperature=0, max_tokens=24, stop=stop, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected


def test_completion_logprobs_in_the_legacy_format(client):
    reply = client.completions.create(
        model="default", prompt="The three primary colors are", temperature=0, max_tokens=10,
        logprobs=3,
    )  # fmt: skip
    choice = reply.choices[0]
    tokens, logprobs = choice.logprobs.tokens, choice.logprobs
    assert "".join(tokens) == choice.text
    assert logprobs.text_offset == [len("".join(tokens[:i])) for i in range(len(tokens))]
    for chosen, value, top in zip(tokens, logprobs.token_logprobs, logprobs.top_logprobs,
                                  strict=True):  # fmt: skip
        assert 1 <= len(top) <= 3 and top.get(chosen) == value == max(top.values())


def test_n_choices_with_logprobs(client):
    reply = client.chat.completions.create(
        model="default", messages=QUESTION, n=3, temperature=1.0, seed=3, max_tokens=12,
        logprobs=True, top_logprobs=2,
    )  # fmt: skip
    assert [c.index for c in reply.choices] == [0, 1, 2]
    contents = [c.message.content for c in reply.choices]
    assert len(set(contents)) > 1
    for choice in reply.choices:
        assert "".join(t.token for t in choice.logprobs.content) == choice.message.content
        assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)


# ---- seeds, min_tokens ----------------------------------------------------------------------


def test_seeds_reproduce_under_concurrent_batching(base_url, client):
    def request(seed: int) -> dict:
        return dict(
            model="default",
            messages=QUESTION,
            temperature=1.0,
            seed=seed,
            max_tokens=12,
            extra_body={"ignore_eos": True},
        )

    async def eight_at_once() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="x") as async_client:
            replies = await asyncio.gather(
                *(async_client.chat.completions.create(**request(seed)) for seed in range(8))
            )
        return [r.choices[0].message.content for r in replies]

    together = asyncio.run(eight_at_once())
    alone = [client.chat.completions.create(**request(seed)).choices[0].message.content
             for seed in range(8)]  # fmt: skip
    assert together == alone
    assert len(set(together)) > 4


def test_min_tokens_holds_off_the_end(client):
    messages = [{"role": "user", "content": "Reply with the single word: yes"}]
    short = client.chat.completions.create(
        model="default", messages=messages, temperature=0, max_tokens=40
    )
    assert short.choices[0].finish_reason == "stop"
    at_least = short.usage.completion_tokens + 5
    longer = client.chat.completions.create(
        model="default", messages=messages, temperature=0, max_tokens=40,
        extra_body={"min_tokens": at_least},
    )  # fmt: skip
    assert longer.usage.completion_tokens >= at_least


# ---- completions prompts --------------------------------------------------------------------


def test_echo_and_token_id_prompts(client, engine):
    prompt = "The capital of France is"
    ids = engine.tokenizer.encode(prompt)
    greedy = dict(model="default", temperature=0, max_tokens=6)
    text = client.completions.create(prompt=prompt, **greedy).choices[0].text
    assert client.completions.create(prompt=ids, **greedy).choices[0].text == text
    echoed = client.completions.create(prompt=prompt, echo=True, **greedy).choices[0].text
    assert echoed == prompt + text

    other = "Water boils at"
    other_text = client.completions.create(prompt=other, **greedy).choices[0].text
    batch = client.completions.create(prompt=[ids, engine.tokenizer.encode(other)], **greedy)
    assert [(c.index, c.text) for c in batch.choices] == [(0, text), (1, other_text)]
    assert batch.usage.prompt_tokens == len(ids) + len(engine.tokenizer.encode(other))
