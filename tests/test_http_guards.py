"""Guards against clients that misbehave at the HTTP level, each on a real uvicorn server: the
Host check (DNS rebinding), slow clients (trickled headers and bodies, responses nobody
reads), request ids unique among requests in flight, the priority floor, and text that is no
Unicode in fields the Responses API echoes back."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time

import httpx
import pytest
from server_helpers import running_app
from test_hardening import TextEngine

from server.app import HttpOptions, build_app
from server.async_engine import AsyncEngine
from server.cli import build_parser
from server.http.body_limit import MAX_JSON_VALUES, json_value_count
from server.http.client_timeouts import ResponseDeadline
from server.http.connections import server_protocol
from server.http.host_check import allowed_hosts, host_name
from server.launch import _http_options

COMPLETION = {"model": "m", "prompt": "hi", "max_tokens": 2}
TIMEOUT_S = 0.5  # the client timeout of the slow-client tests
# What "cut off in time" allows past the timeout: a loaded 2-core machine is slow to schedule.
SLACK_S = 2.0


@contextlib.contextmanager
def serving(options: HttpOptions | None = None, http: type | None = None):
    engine = TextEngine()
    app = build_app(AsyncEngine(engine), "m", options=options)
    with running_app(app, http=http) as url:
        try:
            yield engine, app, url
        finally:
            engine.gate.set()


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


# ---- Host header ------------------------------------------------------------------------------


def test_a_loopback_server_answers_only_loopback_names():
    with serving(HttpOptions(allowed_hosts=allowed_hosts("127.0.0.1"))) as (_, _, url):
        port = _port(url)
        for name in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", "LOCALHOST"):
            assert httpx.get(f"{url}/health", headers={"Host": name}).status_code == 200
        # A rebinding page's requests name its own domain, even when it resolves to us.
        rebound = httpx.post(
            f"{url}/v1/completions", json=COMPLETION, headers={"Host": f"evil.test:{port}"}
        )
        assert rebound.status_code == 400
        error = rebound.json()["error"]
        assert error["code"] == "invalid_host" and "--allowed-hosts" in error["message"]
        anthropic = httpx.post(f"{url}/v1/messages", json={}, headers={"Host": "evil.test"})
        assert anthropic.json()["type"] == "error"  # in the called API's error shape
        assert httpx.get(f"{url}/metrics", headers={"Host": "evil.test"}).status_code == 400


def test_the_serve_command_turns_the_host_check_on_for_loopback_binds():
    def options(*argv: str) -> HttpOptions:
        return _http_options(build_parser(["serve"]).parse_args(["serve", *argv]))

    assert options().allowed_hosts == frozenset({"localhost", "127.0.0.1", "::1"})
    assert "mymac.local" in options("--allowed-hosts", "mymac.local").allowed_hosts
    assert options("--host", "0.0.0.0").allowed_hosts is None
    assert options("--host", "0.0.0.0", "--allowed-hosts", "a.test").allowed_hosts == {"a.test"}
    assert options("--allowed-hosts", "*").allowed_hosts is None


def test_host_names_lose_their_port_and_brackets():
    assert host_name("LocalHost:8000") == "localhost"
    assert host_name("[::1]:8000") == "::1"
    assert host_name("::1") == "::1"
    assert host_name("example.test") == "example.test"


# ---- slow clients -----------------------------------------------------------------------------


def _connect(url: str) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", _port(url)))
    sock.settimeout(TIMEOUT_S + SLACK_S)
    return sock


def _closed_within(sock: socket.socket, limit_s: float) -> bool:
    """Whether the server closes `sock` within `limit_s` (reading whatever it sends first)."""
    deadline = time.monotonic() + limit_s
    with contextlib.suppress(OSError):  # a reset is a close too
        while time.monotonic() < deadline:
            sock.settimeout(max(deadline - time.monotonic(), 0.01))
            if sock.recv(4096) == b"":
                return True
    return False


def test_headers_trickled_byte_by_byte_are_cut_off():
    with serving(http=server_protocol(TIMEOUT_S, 1024)) as (_, _, url):
        sock = _connect(url)
        start = time.monotonic()
        head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Padding: "
        # A byte every 0.1 s would keep an idle timer from ever firing.
        with contextlib.suppress(OSError):
            for i in range(len(head) + 40):
                sock.sendall(head[i : i + 1] or b"a")
                time.sleep(0.1)
                if time.monotonic() - start > TIMEOUT_S + SLACK_S:
                    break
        assert _closed_within(sock, 0.5), "the server kept the connection open"
        assert time.monotonic() - start < TIMEOUT_S + SLACK_S + 0.5
        assert httpx.get(f"{url}/health").status_code == 200


def test_a_silent_connection_is_closed():
    with serving(http=server_protocol(TIMEOUT_S, 1024)) as (_, _, url):
        sock = _connect(url)
        assert _closed_within(sock, TIMEOUT_S + SLACK_S)


def test_a_trickled_body_gets_a_408_and_frees_the_drain():
    options = HttpOptions(client_timeout_s=TIMEOUT_S)
    with serving(options, http=server_protocol(TIMEOUT_S, 1024)) as (_, app, url):
        sock = _connect(url)
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"
        )
        start = time.monotonic()
        reply = b""
        with contextlib.suppress(OSError):
            while b"\r\n\r\n" not in reply and time.monotonic() - start < TIMEOUT_S + SLACK_S:
                sock.sendall(b" ")
                sock.settimeout(0.1)
                with contextlib.suppress(TimeoutError):
                    reply += sock.recv(4096)
        assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
        assert b'"request_timeout"' in reply or b"request_timeout" in sock.recv(4096)
        deadline = time.monotonic() + SLACK_S
        while app.state.drain.in_flight and time.monotonic() < deadline:
            time.sleep(0.02)
        assert app.state.drain.in_flight == 0  # a shutdown would not wait for it


def test_a_response_nobody_reads_is_dropped_after_the_timeout():
    """uvicorn's `send` blocks while the client's socket is full; the stream then ends as if
    the client had gone, so its generation is aborted and the handler returns."""
    sent, closed = [], asyncio.Event()

    async def streaming_app(scope, receive, send):
        try:
            await send({"type": "http.response.start", "status": 200, "headers": []})
            for i in range(1000):
                await send({"type": "http.response.body", "body": b"x", "more_body": True})
                sent.append(i)
        finally:
            closed.set()

    async def full_socket_send(message):
        if sent:  # the client read the head and the first piece, then stopped
            await asyncio.Event().wait()

    async def run() -> float:
        start = asyncio.get_running_loop().time()
        guarded = ResponseDeadline(streaming_app, timeout_s=TIMEOUT_S)
        await asyncio.wait_for(guarded({"type": "http"}, None, full_socket_send), 10)
        return asyncio.get_running_loop().time() - start

    elapsed = asyncio.run(run())
    assert closed.is_set() and len(sent) == 1
    assert TIMEOUT_S <= elapsed < TIMEOUT_S + SLACK_S


# ---- request ids ------------------------------------------------------------------------------


def test_requests_in_flight_never_share_an_id():
    engine = TextEngine()
    bridge = AsyncEngine(engine)
    with running_app(build_app(bridge, "m")) as url:
        engine.gate.clear()  # both requests wait on the engine, so both are in flight
        answers: list[httpx.Response] = []

        def post() -> None:
            headers = {"X-Request-Id": "trace-7"}
            answers.append(httpx.post(f"{url}/v1/completions", json=COMPLETION, headers=headers))

        def wait_for(condition) -> None:
            deadline = time.monotonic() + 5
            while not condition() and time.monotonic() < deadline:
                time.sleep(0.01)

        # The second arrives while the engine holds the first in a step (the order a loaded
        # machine gives), so it is counted at the bridge: it cannot reach the engine yet.
        threads = [threading.Thread(target=post) for _ in range(2)]
        threads[0].start()
        wait_for(lambda: engine.requests)
        threads[1].start()
        wait_for(lambda: len(bridge.live_requests()) == 2)
        engine.gate.set()
        for thread in threads:
            thread.join(10)
        ids = sorted(answer.headers["x-request-id"] for answer in answers)
        assert ids[0] == "trace-7" and ids[1].startswith("trace-7~") and ids[0] != ids[1]
        later = httpx.get(f"{url}/health", headers={"X-Request-Id": "trace-7"})
        assert later.headers["x-request-id"] == "trace-7"  # free again once they ended


# ---- priority ---------------------------------------------------------------------------------


def test_clients_may_defer_but_not_jump_the_queue():
    with serving() as (_, _, url):
        jump = httpx.post(f"{url}/v1/completions", json={**COMPLETION, "priority": -100})
        assert jump.status_code == 400
        error = jump.json()["error"]
        assert error["param"] == "priority" and "--min-request-priority" in error["message"]
        defer = httpx.post(f"{url}/v1/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": "hi"}], "priority": 5,
        })  # fmt: skip
        assert defer.json()["error"]["param"] != "priority"  # (this tokenizer has no template)
        assert httpx.post(f"{url}/v1/completions", json={**COMPLETION, "priority": 3}).is_success
    with serving(HttpOptions(min_priority=-100)) as (_, _, url):
        allowed = httpx.post(f"{url}/v1/completions", json={**COMPLETION, "priority": -100})
        assert allowed.is_success


def test_the_priority_floor_is_a_serve_option():
    parser = build_parser(["serve"])
    args = parser.parse_args(["serve", "--min-request-priority", "-5"])
    assert _http_options(args).min_priority == -5
    assert _http_options(parser.parse_args(["serve"])).min_priority == 0


# ---- Unicode in echoed fields -----------------------------------------------------------------


@pytest.mark.parametrize(
    "extra",
    [
        {"metadata": {"note": "\ud800"}},
        {"metadata": {"\udc00": "x"}},
        {"text": {"format": {"type": "json_schema", "name": "a\ud800", "schema": {}}}},
    ],
)
def test_lone_surrogates_in_echoed_responses_fields_are_a_400_before_any_work(extra):
    with serving() as (engine, _, url):
        body = json.dumps({"model": "m", "input": "hi", **extra})  # "\ud800" escapes
        headers = {"Content-Type": "application/json"}
        answer = httpx.post(f"{url}/v1/responses", content=body, headers=headers)
        assert answer.status_code == 400
        assert "lone UTF-16 surrogate" in answer.json()["error"]["message"]
        assert engine.steps == 0


def test_responses_metadata_keeps_openais_limits():
    with serving() as (_, _, url):
        for metadata in ({f"k{i}": "v" for i in range(17)}, {"k" * 65: "v"}, {"k": "v" * 513}):
            body = {"model": "m", "input": "hi", "metadata": metadata}
            answer = httpx.post(f"{url}/v1/responses", json=body)
            assert answer.status_code == 400 and "metadata" in answer.json()["error"]["message"]


# ---- what a body may hold ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "values"),
    [
        (b"", 0), (b"1", 1), (b"[1, 2, 3]", 4), (b'{"a": 1, "b": [2]}', 4),
        (b'["a,b", "c[d{", "\\"],"]', 4),  # separators inside strings are text
        (b'["\\\\", ",", "\\\\\\"[,"]', 4),  # a quote after an escaped backslash ends its string
        (b"[[], {}]", 5),  # an empty array or object counts twice
    ],
)  # fmt: skip
def test_json_values_are_counted_from_the_structure(text, values):
    assert json_value_count(text) == values


def test_a_body_of_too_many_values_is_refused_before_it_is_parsed():
    with serving() as (engine, _, url):
        ids = [1] * (MAX_JSON_VALUES + 1)
        started = time.monotonic()
        answer = httpx.post(f"{url}/v1/completions", json={**COMPLETION, "prompt": ids})
        assert answer.status_code == 413 and time.monotonic() - started < SLACK_S
        assert answer.json()["error"]["code"] == "request_too_large"
        assert str(MAX_JSON_VALUES) in answer.json()["error"]["message"]
        prose = "one, two, [three], {four}, " * 40_000  # commas in text are no values
        parsed = httpx.post(f"{url}/v1/completions", json={**COMPLETION, "prompt": prose})
        assert parsed.json()["error"]["code"] == "context_length_exceeded"  # (a tiny context)


# ---- what a web page can send without a preflight ---------------------------------------------


@pytest.mark.parametrize("content_type", [None, "text/plain;charset=UTF-8",
                                          "application/x-www-form-urlencoded"])
def test_a_body_not_typed_as_json_is_refused(content_type):
    """A page posts a JSON text as a plain-text, form or untyped body (a Blob) to a keyless
    local server with no CORS preflight; each is refused before any route reads it."""
    headers = {} if content_type is None else {"Content-Type": content_type}
    with serving() as (_, _, url):
        for path in ("/v1/completions", "/v1/messages"):
            answer = httpx.post(f"{url}{path}", content=json.dumps(COMPLETION).encode(),
                                headers=headers)  # fmt: skip
            assert answer.status_code == 415, answer.text
            assert "Content-Type: application/json" in answer.text
        typed = httpx.post(f"{url}/v1/completions", json=COMPLETION)
        assert typed.status_code == 200, typed.text


def test_no_api_docs_page_loads_scripts_from_elsewhere_and_claude_codes_probe_answers():
    with serving() as (_, _, url):
        assert httpx.get(f"{url}/docs").status_code == 404
        assert httpx.get(f"{url}/redoc").status_code == 404
        assert httpx.get(f"{url}/openapi.json").status_code == 200
        assert httpx.head(f"{url}/api/hello").status_code == 200
