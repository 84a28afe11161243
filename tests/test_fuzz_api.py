"""Fuzz the server's own OpenAPI schema with schemathesis against a real server over a tiny
random Llama: no request may get a 5xx, and the server must still serve normally afterwards.

Bounded (a few derandomized examples per operation and mode, a short context so generations
stay short) to stay a test-suite test; `FUZZ_EXAMPLES=200 pytest tests/test_fuzz_api.py` runs a
deeper search. Output content does not matter here, so a tiny model keeps generation cheap.
"""

from __future__ import annotations

import os
import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from server_helpers import running_app
from tiny_server import tiny_engine

from server.app import build_app
from server.async_engine import AsyncEngine

pytestmark = pytest.mark.slow

FUZZ_EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "10"))
MAX_MODEL_LEN = 32  # generations stay short whatever max_tokens the fuzzer picks


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    engine = tiny_engine(tmp_path_factory.mktemp("tiny-llama"), MAX_MODEL_LEN)
    with running_app(build_app(AsyncEngine(engine), max_n=2)) as url:
        yield engine, url


def test_no_generated_request_gets_a_server_error(served):
    engine, url = served
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/chat/completions", "/v1/completions"}
    for operation in operations:
        modes = [GenerationMode.POSITIVE]
        if operation.method.upper() == "POST":  # the GET routes take no input to break
            modes.append(GenerationMode.NEGATIVE)
        for mode in modes:
            _fuzz(operation, mode, url)
    assert httpx.get(f"{url}/health").status_code == 200
    reply = httpx.post(f"{url}/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 3})
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3
    _wait_until_idle(engine)
    assert engine.scheduler.pool.num_free_blocks == engine.scheduler.pool.num_blocks


def _fuzz(operation, mode: GenerationMode, url: str) -> None:
    """`FUZZ_EXAMPLES` requests that fit the schema (positive) or break it (negative)."""

    @settings(
        max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True, database=None,
        suppress_health_check=list(HealthCheck),
    )  # fmt: skip
    @given(case=operation.as_strategy(mode))
    def check(case) -> None:
        response = case.call(base_url=url, timeout=60)
        assert response.status_code < 500, (
            f"{operation.label} ({mode}) answered {response.status_code}: {response.text[:500]}\n"
            f"request body: {case.body!r}"
        )

    check()


def _wait_until_idle(engine, timeout: float = 30.0) -> None:
    # A read from another thread: racy in general, good enough to watch for "drained".
    deadline = time.monotonic() + timeout
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "the engine still has unfinished requests"
        time.sleep(0.05)
