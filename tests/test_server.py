"""A real uvicorn server over the real engine and the default model, driven by the openai client."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from server_helpers import small_engine

from metal_engine.engine import LLMEngine

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 256
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


class RecordingEngine:
    """The real engine, with a record of the aborts the server sends it."""

    def __init__(self, engine: LLMEngine) -> None:
        self._engine = engine
        self.aborted: list[str] = []

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    def abort_request(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self._engine.abort_request(request_id)


@pytest.fixture(scope="module")
def engine(default_model_dir) -> RecordingEngine:
    return RecordingEngine(small_engine(default_model_dir, MAX_MODEL_LEN))


def template_len(engine, messages) -> int:
    encoded = engine.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )
    return len(encoded["input_ids"])


def wait_until_idle(engine, timeout: float = 10.0) -> None:
    # A read from another thread: racy in general, good enough to watch for "drained".
    deadline = time.monotonic() + timeout
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "the engine still has unfinished requests"
        time.sleep(0.05)


def wait_for_aborts(engine, request_ids: list[str], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not set(request_ids) <= set(engine.aborted):
        assert time.monotonic() < deadline, f"the server did not abort {request_ids}"
        time.sleep(0.05)


def assert_every_block_free(engine) -> None:
    pool = engine.scheduler.pool
    assert pool.num_free_blocks == pool.num_blocks


def test_models_and_health(client, base_url):
    assert [m.id for m in client.models.list().data] == ["default", "SmolLM2-135M-Instruct"]
    response = httpx.get(f"{base_url}/health")
    assert response.status_code == 200 and response.json() == {"status": "ok"}


def test_greedy_chat_answers_paris(client, engine):
    reply = client.chat.completions.create(
        model="default", messages=QUESTION, temperature=0, max_tokens=24
    )
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].finish_reason in ("stop", "length")
    usage = reply.usage
    assert usage.prompt_tokens == template_len(engine, QUESTION)
    assert 0 < usage.completion_tokens <= 24
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens

    stream = client.chat.completions.create(
        model="anything-goes", messages=QUESTION, temperature=0, max_tokens=24, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reply.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == []
    streamed = chunks[-1].usage
    assert streamed.model_dump(exclude={"prompt_tokens_details"}) == usage.model_dump(
        exclude={"prompt_tokens_details"}
    )
    # The same prompt again: its full blocks now come from the prefix cache.
    assert streamed.prompt_tokens_details.cached_tokens > 0


def test_repeated_chat_reports_cached_prompt_tokens(client, engine):
    messages = [{"role": "user", "content": "Name three rivers of Europe, one per line."}]
    replies = [
        client.chat.completions.create(
            model="default", messages=messages, temperature=0, max_tokens=4
        )
        for _ in range(2)
    ]
    first, second = (r.usage for r in replies)
    block_size = engine.scheduler.config.block_size
    cached = second.prompt_tokens_details.cached_tokens
    assert 0 < cached < second.prompt_tokens and cached % block_size == 0
    assert cached >= second.prompt_tokens - block_size  # all but the last partial block
    assert first.prompt_tokens_details.cached_tokens < cached
    assert replies[0].choices[0].message.content == replies[1].choices[0].message.content


def test_greedy_completion(client, engine):
    prompt = "The capital of France is"
    reply = client.completions.create(model="default", prompt=prompt, temperature=0, max_tokens=6)
    assert "Paris" in reply.choices[0].text
    assert reply.usage.prompt_tokens == len(engine.tokenizer.encode(prompt))
    assert reply.usage.completion_tokens <= 6


def test_sixteen_concurrent_streams(base_url, engine):
    async def one(client: openai.AsyncOpenAI, i: int):
        messages = [{"role": "user", "content": f"Count from {i} to {i + 20}."}]
        stream = await client.chat.completions.create(
            model="default", messages=messages, temperature=0, max_tokens=8, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        chunks = [chunk async for chunk in stream]
        return messages, chunks

    async def all_at_once():
        async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="x") as client:
            return await asyncio.gather(*(one(client, i) for i in range(16)))

    for messages, chunks in asyncio.run(all_at_once()):
        *deltas, last = chunks
        contents = [c.choices[0].delta.content for c in deltas[1:] if c.choices[0].delta.content]
        assert 1 <= len(contents) <= 8  # one chunk per step with text, one token per step
        assert deltas[-1].choices[0].finish_reason == "length"
        assert last.usage.completion_tokens == 8
        assert last.usage.prompt_tokens == template_len(engine, messages)
    wait_until_idle(engine)


def bad_requests() -> list[tuple[str, dict, str | None]]:
    """(path, httpx kwargs, the error's param) of requests that must get a 400."""
    chat = {"model": "default", "messages": QUESTION}
    too_long = [{"role": "user", "content": "word " * (2 * MAX_MODEL_LEN)}]
    return [
        ("/v1/chat/completions", {"content": b'{"messages": [{"role": '}, None),
        ("/v1/chat/completions", {"json": {"model": "default"}}, "messages"),
        ("/v1/chat/completions", {"json": {**chat, "messages": []}}, "messages"),
        ("/v1/chat/completions", {"json": {**chat, "max_tokens": 0}}, "max_tokens"),
        ("/v1/chat/completions", {"json": {**chat, "max_tokens": -1}}, "max_tokens"),
        ("/v1/chat/completions", {"json": {**chat, "messages": too_long}}, "messages"),
        ("/v1/completions", {"json": {"prompt": "word " * (2 * MAX_MODEL_LEN)}}, "prompt"),
    ]


def test_bad_requests_get_openai_errors_while_a_stream_runs(client, base_url):
    stream = client.chat.completions.create(
        model="default", messages=QUESTION, max_tokens=48, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = []
    for chunk in stream:
        chunks.append(chunk)
        if len(chunks) != 2:
            continue
        for path, kwargs, param in bad_requests():  # the stream is live: send them now
            headers = {"content-type": "application/json"}
            response = httpx.post(f"{base_url}{path}", headers=headers, **kwargs)
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert error["type"] == "invalid_request_error" and error["param"] == param
    assert chunks[-1].usage.completion_tokens == 48
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_context_error_names_the_lengths(base_url):
    body = {"prompt": "word " * (2 * MAX_MODEL_LEN), "max_tokens": 4}
    error = httpx.post(f"{base_url}/v1/completions", json=body).json()["error"]
    assert str(MAX_MODEL_LEN) in error["message"] and "tokens" in error["message"]
    assert error["code"] == "context_length_exceeded"


def test_stream_disconnect_aborts_the_request(base_url, engine):
    body = {"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body) as response:
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        request_id = json.loads(first[6:])["id"]
    wait_for_aborts(engine, [request_id])
    wait_until_idle(engine)
    assert_every_block_free(engine)


def test_non_stream_disconnect_aborts_the_request(base_url, engine):
    aborted = len(engine.aborted)
    body = {"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{base_url}/v1/completions", json=body, timeout=1.0)
    deadline = time.monotonic() + 10
    while len(engine.aborted) == aborted:
        assert time.monotonic() < deadline, "the server did not abort the request"
        time.sleep(0.05)
    wait_until_idle(engine)
    assert_every_block_free(engine)


def test_stream_disconnect_aborts_every_choice(base_url, engine):
    body = {"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True, "stream": True,
            "n": 2}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body) as response:
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        request_id = json.loads(first[6:])["id"]
    wait_for_aborts(engine, [f"{request_id}-0", f"{request_id}-1"])
    wait_until_idle(engine)
    assert_every_block_free(engine)


def test_seeded_choices_differ_and_reproduce(client, engine):
    prompt = "Once upon a time"
    sample = dict(model="default", prompt=prompt, max_tokens=8, temperature=1.0, seed=11,
                  extra_body={"ignore_eos": True})
    first, again = (client.completions.create(n=3, **sample) for _ in range(2))
    texts = [c.text for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert len(set(texts)) > 1 and [c.text for c in again.choices] == texts
    assert client.completions.create(n=1, **sample).choices[0].text == texts[0]
    assert first.usage.prompt_tokens == len(engine.tokenizer.encode(prompt))
    assert first.usage.completion_tokens == 3 * 8
    wait_until_idle(engine)


def test_choices_compute_the_prompt_once(client, engine):
    stats = engine.scheduler.prefix_cache.stats
    hits_before = stats.hit_tokens
    prompt = "A lighthouse keeper's log, day one: " + "wind, " * 40
    reply = client.completions.create(
        model="default", prompt=prompt, n=4, temperature=0, max_tokens=4
    )
    block_size = engine.scheduler.config.block_size
    full_blocks = (reply.usage.prompt_tokens - 1) // block_size * block_size
    assert full_blocks >= 3 * block_size
    assert stats.hit_tokens - hits_before == 3 * full_blocks  # every choice but the first
    assert reply.usage.prompt_tokens_details.cached_tokens == 0  # a new prompt
    assert len({c.text for c in reply.choices}) == 1  # greedy: one answer, four times


def test_priority_needs_the_priority_policy(base_url):
    body = {"prompt": "hi", "max_tokens": 2, "priority": 1}
    response = httpx.post(f"{base_url}/v1/completions", json=body)
    assert response.status_code == 400
    assert "--scheduling-policy priority" in response.json()["error"]["message"]
    response = httpx.post(f"{base_url}/v1/completions", json={**body, "priority": 0})
    assert response.status_code == 200
