"""A real uvicorn server on a free port, in a background thread, for tests."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import uvicorn

from metal_engine.config import EngineConfig
from metal_engine.engine import LLMEngine
from metal_engine.engine_build import build_engine
from server.app import build_app
from server.async_engine import AsyncEngine

# Tests need little context; a small pool keeps each test process's memory modest.
TEST_KV_CACHE_MEMORY = 128 << 20


def small_engine(model_dir, max_model_len: int) -> LLMEngine:
    return build_engine(EngineConfig(
        model_dir=model_dir, max_model_len=max_model_len, kv_cache_memory=TEST_KV_CACHE_MEMORY
    ))


@contextlib.contextmanager
def running_server(engine, served_model_name: str = "default") -> Iterator[str]:
    """Serve `engine` until the block exits; yields the base URL (no /v1)."""
    with running_app(build_app(AsyncEngine(engine), served_model_name)) as url:
        yield url


@contextlib.contextmanager
def running_app(app, http: type | None = None, start_timeout_s: float = 30) -> Iterator[str]:
    """Serve an app made by `build_app` until the block exits; yields the base URL. `http`:
    uvicorn's HTTP protocol class, if not its default; `start_timeout_s`: how long its start
    (the app's lifespan startup included) may take."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    protocol = {"http": http} if http is not None else {}
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", **protocol))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
