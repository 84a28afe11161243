"""Rendering and tokenizing a huge prompt must not stall the event loop: while attack requests
with megabyte prompts or hundreds of long tools are tokenized by the default model's real
tokenizer, a running stream keeps its pace and `/health` answers at once."""

from __future__ import annotations

import gc
import json
import threading
import time

import httpx
import pytest
from fake_engine import LengthEngine
from server_helpers import running_app

from server.app import build_app
from server.async_engine import AsyncEngine
from server.heap import freeze_startup_objects

# A stream's tokens come every 10 ms; tokenizing one attack prompt takes ~1 s of CPU. A gap
# or a /health answer slower than this means the loop was held by a prompt.
BOUND_S = 0.5
VICTIM_TOKENS = 10_000  # more than the attacks last: the test hangs up once they are done
CHAT_CHARS = 2_000_000
COMPLETION_PROMPTS, COMPLETION_CHARS = 4, 500_000
TOOLS, DESCRIPTION_CHARS = 512, 2_000
WORDS = "the quick brown fox jumps over the lazy dog; "


class TickingEngine(LengthEngine):
    """One token every 10 ms until the request's max_tokens; prompts are not decoded."""

    max_model_len = 4096  # every attack prompt is too long: it is only rendered and counted

    def add_request(self, request_id, prompt_token_ids, params, priority=0, cache_salt=None):
        self.live[request_id] = [len(prompt_token_ids), 0]
        self.params[request_id] = params
        self.scripts[request_id] = self.script_for(request_id)

    def step(self):
        time.sleep(0.01)
        return super().step()


def _text(chars: int) -> str:
    return (WORDS * (chars // len(WORDS) + 1))[:chars]


def _tools() -> list[dict]:
    schema = {"type": "object", "properties": {"x": {"type": "string"}}}
    return [
        {"type": "function", "function": {
            "name": f"tool_{i}", "description": _text(DESCRIPTION_CHARS), "parameters": schema,
        }}
        for i in range(TOOLS)
    ]  # fmt: skip


def _attacks() -> list[tuple[str, dict]]:
    """(path, body) of requests whose prompts take the tokenizer about a second each."""
    tools = _tools()
    anthropic_tools = [
        {"name": t["function"]["name"], "description": t["function"]["description"],
         "input_schema": t["function"]["parameters"]}
        for t in tools
    ]  # fmt: skip
    hello = [{"role": "user", "content": "hi"}]
    return [
        ("/v1/chat/completions", {"model": "m", "messages": [
            {"role": "user", "content": _text(CHAT_CHARS)}]}),
        ("/v1/completions", {"model": "m", "max_tokens": 1,
                             "prompt": [_text(COMPLETION_CHARS)] * COMPLETION_PROMPTS}),
        ("/v1/chat/completions", {"model": "m", "messages": hello, "tools": tools}),
        ("/v1/responses", {"model": "m", "input": _text(CHAT_CHARS)}),
        ("/v1/messages", {"model": "m", "max_tokens": 1, "messages": hello,
                          "tools": anthropic_tools}),
        ("/v1/messages/count_tokens", {"model": "m", "messages": [
            {"role": "user", "content": _text(CHAT_CHARS)}]}),
    ]  # fmt: skip


@pytest.fixture(scope="module")
def url(default_tokenizer):
    engine = TickingEngine(["x"], default_tokenizer)
    app = build_app(AsyncEngine(engine), "m")
    freeze_startup_objects()  # as `metal-serve serve` does: this process holds the test session
    try:
        with running_app(app) as base:
            yield base
    finally:
        gc.unfreeze()


def _victim(url: str, stop: threading.Event, arrivals: list[float]) -> None:
    body = {"model": "m", "stream": True, "max_tokens": VICTIM_TOKENS,
            "messages": [{"role": "user", "content": "Count."}]}  # fmt: skip
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if stop.is_set():
                arrivals.append(-1.0)  # hung up, still streaming
                break
            if line.startswith("data:"):
                arrivals.append(time.monotonic())


def _poll_health(url: str, stop: threading.Event, latencies: list[float]) -> None:
    with httpx.Client(base_url=url, timeout=30) as client:
        while not stop.is_set():
            start = time.monotonic()
            assert client.get("/health").status_code == 200
            latencies.append(time.monotonic() - start)
            time.sleep(0.02)


@pytest.mark.slow
def test_huge_prompts_stall_neither_a_stream_nor_health(url):
    stop, arrivals, latencies = threading.Event(), [], []
    victim = threading.Thread(target=_victim, args=(url, stop, arrivals))
    victim.start()
    while len(arrivals) < 5:
        assert victim.is_alive(), "the victim stream did not start"
        time.sleep(0.01)
    poller = threading.Thread(target=_poll_health, args=(url, stop, latencies))
    poller.start()
    attack_start = time.monotonic()
    statuses, spans = [], []
    with httpx.Client(base_url=url, timeout=120) as client:
        for path, body in _attacks():
            start = time.monotonic()
            response = client.post(path, content=json.dumps(body),
                                   headers={"content-type": "application/json"})  # fmt: skip
            statuses.append((path, response.status_code, response.text[:120]))
            spans.append((path, start, time.monotonic()))
    attack_end = time.monotonic()
    stop.set()
    poller.join()
    victim.join()
    still_streaming = arrivals.pop() == -1.0
    # Every attack was tokenized in full: each is refused as too long for the context, or
    # counted (count_tokens); nothing reached the engine.
    assert [status for _, status, _ in statuses] == [400, 400, 400, 400, 400, 200], statuses
    during = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)
              if attack_start <= b <= attack_end]  # fmt: skip
    print(f"attacks took {attack_end - attack_start:.2f} s; victim gaps during them: "
          f"max {max(during):.3f} s over {len(during)}; /health max {max(latencies):.3f} s")
    for path, start, end in spans:
        gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False) if start <= b <= end]
        print(f"  {path}: {end - start:.2f} s, max gap {max(gaps, default=0):.3f} s")
    assert still_streaming  # the stream outlasted the attacks
    assert during and max(during) < BOUND_S
    assert max(latencies) < BOUND_S
