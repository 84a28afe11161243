"""The HTTP guards over a scripted engine on a real uvicorn server: API keys on both API styles,
CORS, the body size limit, the waiting-queue limit, request field limits and request ids."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import threading
import time
from types import SimpleNamespace

import anthropic
import httpx
import openai
import pytest
from server_helpers import running_app
from test_server_async_engine import ScriptedEngine

from server.app import HttpOptions, build_app
from server.async_engine import AsyncEngine
from server.cli import main
from server.http.errors import APIError
from server.http.limits import MAX_STOP_SEQUENCES
from server.http.logs import JsonFormatter, RequestIdFilter

KEY = "sk-test-key"
COMPLETION = {"model": "m", "prompt": "hi", "max_tokens": 2}


class CharTokenizer:
    """One token per character: enough for completions with a text prompt."""

    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % 256 for c in text]

    def decode(self, token_ids: list[int], **_) -> str:
        return "".join(chr(t) for t in token_ids)

    def __len__(self) -> int:
        return 256


class TextEngine(ScriptedEngine):
    tokenizer = CharTokenizer()


@contextlib.contextmanager
def serving(
    options: HttpOptions | None = None, max_queued_requests: int | None = None,
    log_prompts: bool = False,
):  # fmt: skip
    """(engine, base URL) of a scripted engine behind an app with `options`."""
    engine = TextEngine()
    bridge = AsyncEngine(engine, max_queued_requests, log_prompts=log_prompts)
    app = build_app(bridge, "m", options=options)
    with running_app(app) as url:
        try:
            yield engine, url
        finally:
            engine.gate.set()  # a held engine would stall the server's shutdown


@pytest.fixture(scope="module")
def keyed_url():
    with serving(HttpOptions(api_keys=(KEY,))) as (_, url):
        yield url


def test_openai_routes_need_the_key(keyed_url):
    client = openai.OpenAI(base_url=f"{keyed_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as caught:
        client.completions.create(**COMPLETION)
    error = caught.value.body
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key"
    missing = httpx.post(f"{keyed_url}/v1/completions", json=COMPLETION)
    assert missing.status_code == 401
    assert missing.json()["error"]["message"].startswith("Missing API key")
    client = openai.OpenAI(base_url=f"{keyed_url}/v1", api_key=KEY, max_retries=0)
    assert client.completions.create(**COMPLETION).choices[0].text == "xx"
    assert [m.id for m in client.models.list().data] == ["m", "scripted"]


def test_anthropic_routes_need_the_key_and_answer_in_their_style(keyed_url):
    client = anthropic.Anthropic(base_url=keyed_url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        client.messages.create(
            model="m", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        )
    response = httpx.post(f"{keyed_url}/v1/messages/count_tokens", json={})
    assert response.status_code == 401
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == "authentication_error"
    assert "x-api-key" in body["error"]["message"]
    # Either header carries the key, whichever API is called.
    for headers in ({"x-api-key": KEY}, {"Authorization": f"Bearer {KEY}"}):
        assert httpx.get(f"{keyed_url}/v1/models", headers=headers).status_code == 200


def test_health_metrics_and_docs_stay_open(keyed_url):
    for path in ("/health", "/metrics", "/openapi.json"):
        assert httpx.get(f"{keyed_url}{path}").status_code == 200, path


def test_cors_is_closed_unless_origins_are_listed():
    origin = "http://localhost:3000"
    preflight = {
        "Origin": origin,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type,x-stainless-os",
    }
    with serving() as (_, url):
        response = httpx.get(f"{url}/v1/models", headers={"Origin": origin})
        assert "access-control-allow-origin" not in response.headers
        assert (
            "access-control-allow-origin"
            not in httpx.options(f"{url}/v1/completions", headers=preflight).headers
        )
    with serving(HttpOptions(api_keys=(KEY,), allowed_origins=(origin,))) as (_, url):
        answer = httpx.options(f"{url}/v1/completions", headers=preflight)
        assert answer.status_code == 200  # preflights carry no key
        assert answer.headers["access-control-allow-origin"] == origin
        refused = httpx.get(f"{url}/v1/models", headers={"Origin": origin})
        assert refused.status_code == 401  # ...and the browser may read why
        assert refused.headers["access-control-allow-origin"] == origin
        other = httpx.get(f"{url}/v1/models", headers={"Origin": "http://evil.example"})
        assert "access-control-allow-origin" not in other.headers


def test_bodies_over_the_limit_get_413():
    with serving(HttpOptions(max_request_body=1000)) as (_, url):
        big = {**COMPLETION, "prompt": "word " * 400}
        response = httpx.post(f"{url}/v1/completions", json=big)
        assert response.status_code == 413
        assert response.json()["error"]["code"] == "request_too_large"

        def chunks():  # no Content-Length: the limit counts what arrives
            for _ in range(20):
                yield b" " * 100

        chunked = httpx.post(f"{url}/v1/completions", content=chunks(),
                             headers={"content-type": "application/json"})  # fmt: skip
        assert chunked.status_code == 413
        anthropic_style = httpx.post(f"{url}/v1/messages", json=big)
        assert anthropic_style.status_code == 413
        assert anthropic_style.json()["error"]["type"] == "request_too_large"
        assert httpx.post(f"{url}/v1/completions", json=COMPLETION).status_code == 200


def test_a_full_queue_answers_429_with_retry_after_before_any_stream():
    with serving(max_queued_requests=1) as (engine, url):
        engine.gate.clear()  # the engine holds its first step: the first request keeps waiting
        first = threading.Thread(
            target=httpx.post, args=(f"{url}/v1/completions",),
            kwargs={"json": COMPLETION, "timeout": 30},
        )  # fmt: skip
        first.start()
        _wait_for(lambda: engine.steps > 0)
        response = httpx.post(f"{url}/v1/completions", json={**COMPLETION, "stream": True})
        assert response.status_code == 429
        assert response.headers["retry-after"] == "1"
        assert response.headers["content-type"] == "application/json"
        assert response.json()["error"]["code"] == "rate_limit_exceeded"
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.RateLimitError):
            client.completions.create(**COMPLETION)
        engine.gate.set()
        first.join(10)
        assert client.completions.create(**COMPLETION).choices[0].text == "xx"


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        ("/v1/completions", {"stop": ["s"] * (MAX_STOP_SEQUENCES + 1)}, "stop"),
        ("/v1/completions", {"logprobs": 21}, "logprobs"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ],
)
def test_field_limits_get_a_400_naming_the_field(keyed_url, path, extra, param):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **COMPLETION, **extra}
    headers = {"Authorization": f"Bearer {KEY}"}
    response = httpx.post(f"{keyed_url}{path}", json=body, headers=headers)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param


def test_request_ids_are_echoed_or_made_up(keyed_url):
    given = httpx.get(f"{keyed_url}/health", headers={"X-Request-Id": "abc-123"})
    assert given.headers["x-request-id"] == "abc-123"
    made = [httpx.get(f"{keyed_url}/health").headers["x-request-id"] for _ in range(2)]
    assert all(m.startswith("req-") for m in made) and made[0] != made[1]
    forged = httpx.get(f"{keyed_url}/health", headers={"X-Request-Id": "a] FAKE LINE [b"})
    assert forged.headers["x-request-id"].startswith("req-")  # never stamped on the log


def test_one_request_tries_one_key_of_each_kind(keyed_url):
    guesses = [("x-api-key", f"guess-{i}") for i in range(600)] + [("x-api-key", KEY)]
    tried = httpx.post(f"{keyed_url}/v1/completions", json=COMPLETION, headers=guesses)
    assert tried.status_code == 401
    both = [("authorization", "Bearer wrong"), ("x-api-key", KEY)]
    answer = httpx.post(f"{keyed_url}/v1/completions", json=COMPLETION, headers=both)
    assert answer.status_code == 200


def _wait_for(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


@pytest.mark.parametrize(
    ("status", "error_type"),
    [(400, "invalid_request_error"), (401, "authentication_error"), (413, "request_too_large"),
     (429, "rate_limit_error"), (500, "api_error"), (503, "overloaded_error")],
)  # fmt: skip
def test_errors_on_anthropic_paths_use_the_anthropic_body(status, error_type):
    error = APIError("bad", status_code=status)
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        body = json.loads(error.response(path).body)
        assert body == {"type": "error", "error": {"type": error_type, "message": "bad"}}
    assert json.loads(error.response("/v1/completions").body)["error"]["message"] == "bad"


@contextlib.contextmanager
def captured_logs():
    """The bridge's log lines, as the server writes them in JSON."""
    text = io.StringIO()
    handler = logging.StreamHandler(text)
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("server.async_engine")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        yield text
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


@pytest.mark.parametrize("log_prompts", [False, True])
def test_log_lines_carry_the_request_id_and_prompts_only_when_asked(log_prompts):
    body = {**COMPLETION, "prompt": "my secret plan"}
    with serving(log_prompts=log_prompts) as (_, url), captured_logs() as text:
        headers = {"X-Request-Id": "trace-7"}
        assert httpx.post(f"{url}/v1/completions", json=body, headers=headers).status_code == 200
    lines = [json.loads(line) for line in text.getvalue().splitlines()]
    assert lines and all(line["request_id"] == "trace-7" for line in lines)
    assert any("ended (length)" in line["message"] for line in lines)
    assert ("my secret plan" in text.getvalue()) == log_prompts


# ---- the command line -----------------------------------------------------------------------


def test_options_reach_the_app_the_bridge_and_the_server(tmp_path, monkeypatch):
    from metal_engine import engine_build
    from metal_engine.loading import parameter_count
    from metal_engine.loading.parameter_count import ParameterCount
    from server import app, launch, model_loading
    from server.http import shutdown

    def text_engine(config) -> TextEngine:
        engine = TextEngine()
        engine.runner = SimpleNamespace(model=SimpleNamespace(config=None))
        return engine

    seen = {}
    monkeypatch.setenv("METAL_SERVE_API_KEY", "key-from-env")
    monkeypatch.setattr(launch, "configure_logging", lambda *args: None)
    monkeypatch.setattr(model_loading, "resolve_model", lambda args: tmp_path)
    monkeypatch.setattr(engine_build, "build_engine", text_engine)
    monkeypatch.setattr(model_loading, "warm_up", lambda engine: None)
    monkeypatch.setattr(parameter_count, "count_parameters", lambda config: ParameterCount(1, 1))
    monkeypatch.setattr(app, "build_app", lambda bridge, name, max_n, options, **_: seen.update(
        bridge=bridge, options=options))  # fmt: skip
    monkeypatch.setattr(shutdown, "run_server", lambda *args: seen.update(
        timeout=args[-3], max_connections=args[-1]))  # fmt: skip
    origins = ["--allowed-origins", "http://a.test, http://b.test"]
    limits = ["--max-request-body", "1MiB", "--max-queued-requests", "5",
              "--max-connections", "300"]
    argv = ["serve", *origins, *limits, "--shutdown-timeout", "7.5", "--log-prompts"]
    assert main(argv) == 0
    assert seen["options"] == HttpOptions(
        ("key-from-env",), ("http://a.test", "http://b.test"), 2**20,
        allowed_hosts=frozenset({"localhost", "127.0.0.1", "::1"}),
    )  # fmt: skip
    assert seen["bridge"].max_queued_requests == 5 and seen["bridge"].log_prompts
    assert seen["timeout"] == 7.5 and seen["max_connections"] == 300


@pytest.mark.parametrize(
    "argv",
    [["--shutdown-timeout", "-1"], ["--max-queued-requests", "0"], ["--max-request-body", "x"],
     ["--log-format", "xml"]],
)  # fmt: skip
def test_bad_options_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", *argv])
    assert exit_info.value.code == 2 and "error:" in capsys.readouterr().err


def test_an_empty_api_key_is_refused_before_loading_the_model(tmp_path, monkeypatch, capsys):
    from server import launch

    monkeypatch.setattr(launch, "configure_logging", lambda *args: None)
    assert main(["serve", str(tmp_path), "--api-key", " "]) == 2
    assert "an API key is empty" in capsys.readouterr().err
