"""SIGTERM on a real `metal-serve serve` process over the default model: new requests get a 503,
a stream that can finish within --shutdown-timeout finishes, one that cannot ends with
finish_reason "abort", and the process exits with code 0."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from server.bench.server_process import free_port

pytestmark = pytest.mark.slow

SHUTDOWN_TIMEOUT_S = 6.0
LONG_MAX_TOKENS = 8000  # more than even a GPU generates in SHUTDOWN_TIMEOUT_S


@pytest.fixture
def server(default_model_dir, tmp_path):
    """(process, base URL, log path) of a `metal-serve serve` started for this test."""
    port = free_port()
    command = [
        str(Path(sys.executable).parent / "metal-serve"), "serve", str(default_model_dir),
        "--port", str(port), "--max-model-len", "8192", "--kv-cache-memory", "512MiB",
        "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S),
    ]  # fmt: skip
    log_path = tmp_path / "server.log"
    with log_path.open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_until_up(process, url, log_path)
        yield process, url, log_path
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def _wait_until_up(process: subprocess.Popen, url: str, log_path: Path) -> None:
    deadline = time.monotonic() + 120
    while True:
        assert process.poll() is None, f"the server died:\n{log_path.read_text()}"
        assert time.monotonic() < deadline, "the server did not come up"
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)


async def stream(client: httpx.AsyncClient, max_tokens: int, started: asyncio.Event) -> list:
    """Every event of a completion stream: its chunks as dicts, then "[DONE]"."""
    body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True}  # fmt: skip
    events: list = []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                data = line.removeprefix("data: ")
                events.append(data if data == "[DONE]" else json.loads(data))
                started.set()
    return events


async def sigterm_during_two_streams(process: subprocess.Popen, url: str):
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        started = [asyncio.Event(), asyncio.Event()]
        short = asyncio.create_task(stream(client, 8, started[0]))
        long = asyncio.create_task(stream(client, LONG_MAX_TOKENS, started[1]))
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
        process.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.3)
        refused = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        return refused, await short, await long


def test_sigterm_drains_then_aborts_and_exits_0(server):
    process, url, log_path = server
    refused, short, long = asyncio.run(sigterm_during_two_streams(process, url))
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "shutting_down"
    for events, reason in ((short, "length"), (long, "abort")):
        assert events[-1] == "[DONE]"
        finishes = [c["choices"][0]["finish_reason"] for c in events[:-1] if c["choices"]]
        assert finishes[-1] == reason and set(finishes[:-1]) == {None}
    assert process.wait(timeout=30) == 0, log_path.read_text()
    log = log_path.read_text()
    assert "draining" in log and "Traceback" not in log
    ended = [line for line in log.splitlines() if " ended (" in line]
    assert len(ended) == 2 and all(" [req-" in line for line in ended)
    assert "Once upon a time" not in log  # no prompt text without --log-prompts
