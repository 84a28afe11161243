"""A victim for denial-of-service tests: one stream and a `/health` poller that run while an
attack does, recording how long each waited at worst."""

from __future__ import annotations

import json
import threading
import time

import httpx

from server.bench.sse import SSEDecoder

# What a victim may wait at worst while an attack runs: a few decode steps of the default
# model on a busy 2-core machine (the attacker's client shares the process), far below the
# seconds each attack once cost (28 s for a logit_bias flood, 4-12 s for a slow schema).
GAP_BOUND_S = 2.0


class Victim:
    """`with Victim(url) as victim:` streams a long chat answer and polls `/health` every
    50 ms until the block ends and the stream is done; then `max_gap` (between stream
    chunks after the first) and `max_health` (one /health round trip) are known."""

    def __init__(self, url: str, max_tokens: int = 160) -> None:
        self.url = url
        self.max_tokens = max_tokens
        self.chunk_times: list[float] = []
        self.health_times: list[float] = []
        self.finish_reason: str | None = None
        self._started = threading.Event()
        self._done = threading.Event()
        self._threads = [threading.Thread(target=self._stream), threading.Thread(target=self._poll)]

    def __enter__(self) -> Victim:
        for thread in self._threads:
            thread.start()
        assert self._started.wait(120), "the victim's stream never started"
        return self

    def __exit__(self, *exc) -> None:
        for thread in self._threads:
            thread.join(300)
        assert self.finish_reason == "length", "the victim's stream did not end whole"

    @property
    def max_gap(self) -> float:
        times = self.chunk_times
        return max((b - a for a, b in zip(times, times[1:], strict=False)), default=0.0)

    @property
    def max_health(self) -> float:
        return max(self.health_times, default=0.0)

    def _stream(self) -> None:
        body = {
            "model": "m", "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
        }  # fmt: skip
        decoder = SSEDecoder()
        try:
            with httpx.stream("POST", f"{self.url}/v1/chat/completions", json=body,
                              timeout=300) as response:  # fmt: skip
                for piece in response.iter_text():
                    for data in decoder.feed(piece):
                        if data.strip() == "[DONE]":
                            continue
                        for choice in json.loads(data).get("choices") or ():
                            if choice["delta"].get("content"):
                                self.chunk_times.append(time.monotonic())
                                self._started.set()
                            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        finally:
            self._started.set()
            self._done.set()

    def _poll(self) -> None:
        while not self._done.is_set():
            start = time.monotonic()
            assert httpx.get(f"{self.url}/health", timeout=60).status_code == 200
            self.health_times.append(time.monotonic() - start)
            time.sleep(0.05)
