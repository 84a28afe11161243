"""The prompt worker over a real uvicorn server: prompts waiting to be tokenized count
toward --max-queued-requests, a prompt whose client hung up is never rendered, short prompts
never wait behind long ones, and text too long for the context is refused untokenized."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
from fake_engine import CharTokenizer, ScriptedEngine
from server_helpers import running_app

from server import prompt_worker
from server.app import build_app
from server.async_engine import AsyncEngine
from server.prompt_worker import LONG_PROMPT_BYTES, max_prompt_text_bytes

WAIT_S = 10.0


class GatedTokenizer(CharTokenizer):
    """Renders a conversation whose text holds "hold" only once `gate` opens (`holding` is
    set meanwhile); records the first message of every conversation it renders."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.holding = threading.Event()
        self.rendered: list[str] = []

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        if "hold" in messages[0]["content"]:
            self.holding.set()
            assert self.gate.wait(WAIT_S)
        self.rendered.append(messages[0]["content"])
        return super().apply_chat_template(messages, add_generation_prompt, tokenize)


@pytest.fixture
def served():
    tokenizer = GatedTokenizer()
    engine = ScriptedEngine(["ok"], tokenizer)
    engine.max_model_len = 1 << 20  # room for a long prompt
    bridge = AsyncEngine(engine, max_queued_requests=4)
    with running_app(build_app(bridge, "m")) as url:
        yield tokenizer, bridge, url
    tokenizer.gate.set()


def _chat(text: str) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": text}]}).encode()


def _raw_post(port: int, body: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
    sock.sendall(head.encode() + body)
    return sock


def _until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def _post_in_background(url: str, text: str, answers: list) -> threading.Thread:
    def post() -> None:
        answers.append(httpx.post(f"{url}/v1/chat/completions", content=_chat(text),
                                  headers={"content-type": "application/json"}, timeout=30))

    thread = threading.Thread(target=post)
    thread.start()
    return thread


def test_prompts_of_clients_that_hung_up_are_never_rendered(served):
    tokenizer, bridge, url = served
    port = int(url.rsplit(":", 1)[1])
    answers: list = []
    holder = _post_in_background(url, "hold the worker", answers)
    assert tokenizer.holding.wait(WAIT_S)
    gone = [_raw_post(port, _chat(f"gone {i}")) for i in range(3)]
    _until(lambda: bridge.prompts_waiting() == 3, "the hung-up prompts never queued")
    assert 'metal_serve_prompts_waiting{engine="0",model_name="m"} 3.0' in httpx.get(
        f"{url}/metrics").text
    for sock in gone:
        sock.close()
    _until(lambda: bridge.prompts_waiting() == 0, "the hung-up prompts stayed queued")
    tokenizer.gate.set()
    holder.join(WAIT_S)
    assert answers and answers[0].status_code == 200, answers
    assert tokenizer.rendered == ["hold the worker"]


def test_waiting_prompts_count_toward_the_queue_limit(served):
    tokenizer, bridge, url = served
    answers: list = []
    threads = [_post_in_background(url, "hold", answers)]
    assert tokenizer.holding.wait(WAIT_S)
    threads += [_post_in_background(url, f"queued {i}", answers) for i in range(3)]
    _until(lambda: bridge.prompts_waiting() == 3, "the prompts never queued")
    refused = httpx.post(f"{url}/v1/chat/completions", content=_chat("one too many"),
                         headers={"content-type": "application/json"}, timeout=30)
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    tokenizer.gate.set()
    for thread in threads:
        thread.join(WAIT_S)
    assert sorted(a.status_code for a in answers) == [200] * 4


def test_a_short_prompt_does_not_wait_behind_a_long_one(served):
    tokenizer, bridge, url = served
    answers: list = []
    long_text = "hold " + "x" * LONG_PROMPT_BYTES
    holder = _post_in_background(url, long_text, answers)
    assert tokenizer.holding.wait(WAIT_S)
    short = httpx.post(f"{url}/v1/chat/completions", content=_chat("short"),
                       headers={"content-type": "application/json"}, timeout=WAIT_S)
    assert short.status_code == 200 and tokenizer.rendered == ["short"]
    tokenizer.gate.set()
    holder.join(WAIT_S)
    assert answers[0].status_code == 200


class VocabTokenizer(CharTokenizer):
    """A vocabulary whose longest token is 3 bytes."""

    def get_vocab(self) -> dict[str, int]:
        return {"a": 0, "bc": 1, "déf"[:2] + "f": 2}


def test_text_longer_than_the_context_can_hold_is_refused_untokenized():
    tokenizer = VocabTokenizer()
    limit = max_prompt_text_bytes(tokenizer, 64)
    assert limit == 2 * 64 * 4  # "déf"[:2] + "f" is 4 bytes of UTF-8
    encoded: list[str] = []
    tokenizer.encode = lambda text, add_special_tokens=True: encoded.append(text) or [1]
    engine = ScriptedEngine(["ok"], tokenizer)
    engine.max_model_len = 64
    bridge = AsyncEngine(engine)
    with running_app(build_app(bridge, "m")) as url:
        answer = httpx.post(f"{url}/v1/completions", timeout=30,
                            json={"model": "m", "prompt": "x" * (limit + 1), "max_tokens": 1})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["code"] == "context_length_exceeded"
    assert encoded == []


def test_long_prompts_wait_only_up_to_a_bound_on_their_bytes(served, monkeypatch):
    tokenizer, bridge, url = served
    monkeypatch.setattr(prompt_worker, "LONG_PROMPTS_WAITING_BYTES", 3 * LONG_PROMPT_BYTES // 2)
    answers: list = []
    long_text = "x" * LONG_PROMPT_BYTES
    threads = [_post_in_background(url, "hold " + long_text, answers)]
    assert tokenizer.holding.wait(WAIT_S)
    threads.append(_post_in_background(url, long_text, answers))
    _until(lambda: bridge.prompts_waiting() == 1, "the long prompt never queued")
    refused = httpx.post(f"{url}/v1/chat/completions", content=_chat(long_text),
                         headers={"content-type": "application/json"}, timeout=30)
    assert refused.status_code == 429 and "MiB of long prompts" in refused.text
    short = httpx.post(f"{url}/v1/chat/completions", content=_chat("short"),
                       headers={"content-type": "application/json"}, timeout=WAIT_S)
    assert short.status_code == 200
    tokenizer.gate.set()
    for thread in threads:
        thread.join(WAIT_S)
    assert [a.status_code for a in answers] == [200, 200]
