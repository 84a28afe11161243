"""The render routes answer the token ids that the generating routes schedule for the same
body (what vllm-router's `cache_aware` policy compares across replicas, docs/router.md)."""

from __future__ import annotations

import httpx
import pytest
from fake_engine import RecordingEngine
from server_helpers import running_app

from server.app import build_app
from server.async_engine import AsyncEngine

pytestmark = pytest.mark.slow  # the default model's tokenizer and chat template

TOOL = {"type": "function", "function": {"name": "read_file", "description": "Read a file.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}
CHAT = {"model": "m", "max_tokens": 2, "tools": [TOOL], "user": "session-1",
        "messages": [{"role": "system", "content": "You are terse."},
                     {"role": "user", "content": "Open README.md"}]}  # fmt: skip
RESPONSE = {"model": "m", "max_output_tokens": 2, "instructions": "You are terse.",
            "input": "Open README.md", "prompt_cache_key": "session-1"}  # fmt: skip
COMPLETION = {"model": "m", "max_tokens": 2, "prompt": ["Once upon", "a time"]}


@pytest.fixture(scope="module")
def served(default_tokenizer):
    engine = RecordingEngine(default_tokenizer)
    with running_app(build_app(AsyncEngine(engine), "m")) as url:
        yield httpx.Client(base_url=url, timeout=30), engine


@pytest.mark.parametrize("route, body", [
    ("/v1/chat/completions", CHAT), ("/v1/responses", RESPONSE),
])  # fmt: skip
def test_render_is_the_generated_prompt(served, route, body):
    client, engine = served
    rendered = client.post(f"{route}/render", json=body)
    assert rendered.status_code == 200, rendered.text
    assert client.post(route, json=body).status_code == 200
    assert rendered.json() == {"token_ids": engine.prompt_ids[-1]}


def test_completions_render_each_prompt(served):
    client, engine = served
    rendered = client.post("/v1/completions/render", json=COMPLETION)
    assert rendered.status_code == 200, rendered.text
    before = len(engine.prompt_ids)
    assert client.post("/v1/completions", json=COMPLETION).status_code == 200
    assert rendered.json() == [{"token_ids": ids} for ids in engine.prompt_ids[before:]]


def test_render_refuses_what_generation_refuses(served):
    client, _ = served
    body = {**CHAT, "messages": [{"role": "wizard", "content": "x"}]}
    rendered = client.post("/v1/chat/completions/render", json=body)
    assert rendered.status_code == 400
    assert rendered.json()["error"]["param"] == "messages[0].role"
