"""A disconnect storm against a real server (the real engine over a tiny random model): 100
streaming clients leave after their first token; afterwards every KV block is free and the
server still answers normally."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
from server_helpers import running_server
from test_server import RecordingEngine
from tiny_server import tiny_engine

NUM_CLIENTS = 100


async def first_token_then_leave(client: httpx.AsyncClient, i: int) -> str:
    body = {"prompt": [3 + i % 100, 5, 7, 9], "max_tokens": 200, "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                return line  # leaving the block closes the connection mid-stream
    raise AssertionError("the stream ended before its first token")


async def storm(base_url: str) -> list[str]:
    limits = httpx.Limits(max_connections=NUM_CLIENTS)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=60) as client:
        clients = (first_token_then_leave(client, i) for i in range(NUM_CLIENTS))
        return await asyncio.gather(*clients)


def test_dropped_streams_free_every_block(tmp_path):
    engine = RecordingEngine(tiny_engine(tmp_path))
    with running_server(engine) as url:
        firsts = asyncio.run(storm(url))
        assert len(firsts) == NUM_CLIENTS
        deadline = time.monotonic() + 30
        while len(engine.aborted) < NUM_CLIENTS:  # each disconnect aborts its request
            assert time.monotonic() < deadline, f"only {len(engine.aborted)} aborts arrived"
            time.sleep(0.05)
        # Reads from another thread: racy in general, good enough to watch for "drained".
        while engine.has_unfinished_requests():
            assert time.monotonic() < deadline, "the aborted requests are still running"
            time.sleep(0.05)
        pool = engine.scheduler.pool
        assert pool.num_free_blocks == pool.num_blocks
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        reply = client.completions.create(model="m", prompt=[3, 4, 5], max_tokens=6)
        assert reply.choices[0].finish_reason == "length"
        assert reply.usage.completion_tokens == 6
