"""Where prompts are tokenized: on the prompt worker's short lane for small bodies, never on the
event loop, for every API; and only once the request's count of choices (`n` times its
prompts) is known to fit `--max-n`."""

from __future__ import annotations

import threading

import httpx
import pytest
from fake_engine import CharTokenizer, ScriptedEngine
from server_helpers import running_app

from server.app import build_app
from server.async_engine import AsyncEngine

MAX_N = 4


class WatchedTokenizer(CharTokenizer):
    """Records the thread of every render and encode."""

    def __init__(self) -> None:
        self.threads: list[str] = []

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        self.threads.append(threading.current_thread().name)
        return super().apply_chat_template(messages, add_generation_prompt, tokenize)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.threads.append(threading.current_thread().name)
        return super().encode(text, add_special_tokens)


@pytest.fixture(scope="module")
def served():
    tokenizer = WatchedTokenizer()
    app = build_app(AsyncEngine(ScriptedEngine(["ok"], tokenizer)), "m", max_n=MAX_N)
    with running_app(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        yield tokenizer, client


HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": HI}),
    ("/v1/completions", {"prompt": ["a", "b"], "max_tokens": 2}),
    ("/v1/responses", {"input": "hi"}),
    ("/v1/messages", {"messages": HI, "max_tokens": 2}),
    ("/v1/messages/count_tokens", {"messages": HI}),
])  # fmt: skip
def test_prompts_are_tokenized_on_the_prompt_worker(served, path, body):
    tokenizer, client = served
    tokenizer.threads.clear()
    assert client.post(path, json={"model": "m", **body}).status_code == 200
    assert tokenizer.threads and set(tokenizer.threads) == {"prompt-short"}


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": ["a", "b", "c"], "n": 2}),  # 6 choices
    ("/v1/completions", {"prompt": "a", "n": MAX_N + 1}),
    ("/v1/completions", {"prompt": ["a"] * (MAX_N + 1)}),
    ("/v1/chat/completions", {"messages": HI, "n": MAX_N + 1}),
])  # fmt: skip
def test_too_many_choices_are_refused_before_any_prompt_is_tokenized(served, path, body):
    tokenizer, client = served
    tokenizer.threads.clear()
    response = client.post(path, json={"model": "m", **body})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "n"
    assert tokenizer.threads == []
