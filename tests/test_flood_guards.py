"""Floods against a real `metal-serve serve` process: idle connections past its open-file
limit, and huge prompts whose clients hang up, must not stall `/health` or other clients'
requests, nor fill the log."""

from __future__ import annotations

import json
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from server.bench.server_process import free_port, running_server

pytestmark = pytest.mark.slow

# macOS starts processes with 256 open files; the flood is well past that.
OPEN_FILE_LIMIT = 256
IDLE_CONNECTIONS = 400
HEALTH_BOUND_S = 1.0
LOG_BOUND_BYTES = 64 << 10
VICTIM_TOKENS = 160


def _serve_command(model_dir: Path, port: int, *options: str) -> list[str]:
    serve = [str(Path(sys.executable).parent / "metal-serve"), "serve", str(model_dir),
             "--port", str(port), "--max-model-len", "256", "--kv-cache-memory", "64MiB",
             *options]  # fmt: skip
    # Both limits, so the server cannot raise its own past what a stock Mac gives it.
    return ["sh", "-c", f'ulimit -n {OPEN_FILE_LIMIT} && exec "$@"', "sh", *serve]


def _health_time(url: str) -> float:
    started = time.monotonic()
    assert httpx.get(f"{url}/health", timeout=8.0).status_code == 200
    return time.monotonic() - started


def test_idle_connections_past_the_file_limit_leave_health_answering(
    tiny_llama_with_tokenizer, tmp_path
):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "server.log"
    with running_server(_serve_command(tiny_llama_with_tokenizer, port), url, log_path,
                        timeout_s=120):  # fmt: skip
        idle = []
        try:
            for _ in range(IDLE_CONNECTIONS):
                sock = socket.socket()
                sock.settimeout(5)
                sock.connect(("127.0.0.1", port))  # and then says nothing
                idle.append(sock)
            time.sleep(2.0)  # the server accepts (and sheds) what the flood opened
            times = [_health_time(url) for _ in range(3)]
            time.sleep(3.0)  # a server out of descriptors would log all along
        finally:
            for sock in idle:
                sock.close()
    assert max(times) < HEALTH_BOUND_S, times
    log = log_path.read_text(errors="replace")
    assert len(log.encode()) < LOG_BOUND_BYTES, log[-2000:]
    assert "Traceback" not in log, log[-2000:]


def _send_and_hang_up(port: int, body: bytes) -> None:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
        sock.sendall(head.encode() + body)


def _victim_time(url: str) -> float:
    started = time.monotonic()
    # An answer of about a second, as the probe's victim had (2.1 s on its machine): 48 tokens
    # took that long before speculation; with it, 160 do. The bound is about work done for
    # the clients that left (tokenizing each took seconds), not the ~0.15 s it takes to
    # receive and parse their 62 MB.
    answer = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": "m", "max_tokens": VICTIM_TOKENS, "ignore_eos": True, "temperature": 0,
        "messages": [{"role": "user", "content": "Write a short story about a robot."}]})
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == VICTIM_TOKENS
    return time.monotonic() - started


def test_huge_prompts_of_clients_that_hang_up_do_not_delay_a_victim(default_model_dir, tmp_path):
    """8 chat requests of 7.8 MB, each client gone once it has sent it: a small request
    right behind them answers within twice its time on an idle server."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    text = ("lorem ipsum dolor sit amet, " * 300_000)[:7_800_000]
    huge = json.dumps({"model": "m", "messages": [{"role": "user", "content": text}]}).encode()
    serve = [str(Path(sys.executable).parent / "metal-serve"), "serve", str(default_model_dir),
             "--port", str(port), "--max-model-len", "8192", "--kv-cache-memory", "512MiB"]
    with running_server(serve, url, tmp_path / "server.log", timeout_s=120):
        _victim_time(url)  # warm up
        idle = statistics.median(_victim_time(url) for _ in range(3))
        senders = [threading.Thread(target=_send_and_hang_up, args=(port, huge))
                   for _ in range(8)]
        for sender in senders:
            sender.start()
        for sender in senders:
            sender.join()
        loaded = _victim_time(url)
    print(f"victim: {loaded:.2f} s behind the flood, {idle:.2f} s idle")
    assert loaded < 2 * idle, (loaded, idle)
