"""What the server's log holds, read from its own handler (`log_handler`, as `metal-serve serve`
configures it) on a real port with uvicorn's loggers routed to it: client text appears only
with --log-prompts, and a client's request id cannot forge a line."""

from __future__ import annotations

import contextlib
import io
import logging
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from fake_engine import CharTokenizer, ScriptedEngine

from server.app import build_app
from server.async_engine import AsyncEngine
from server.http.logs import LogFormat, log_handler, withheld_traceback

SECRET = "PIN-8461"


@contextlib.contextmanager
def logged_server(
    engine, log_prompts: bool = False, log_format: LogFormat = "text"
) -> Iterator[tuple[str, io.StringIO]]:
    """(base URL, the server's log so far) of `engine` served as `metal-serve serve` serves:
    uvicorn without its own log config, every logger to the one handler."""
    text = io.StringIO()
    handler = log_handler(log_format, log_prompts, stream=text)
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    # Servers of other tests ran uvicorn's own log config, which detaches its loggers.
    uvicorns = [logging.getLogger(name) for name in ("uvicorn", "uvicorn.error", "uvicorn.access")]
    saved = [(log.handlers, log.propagate, log.disabled) for log in uvicorns]
    for log in uvicorns:
        log.handlers, log.propagate, log.disabled = [], True, False
    app = build_app(AsyncEngine(engine, log_prompts=log_prompts), "m")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, log_level="info"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    try:
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", text
    finally:
        server.should_exit = True
        thread.join(10)
        root.removeHandler(handler)
        root.setLevel(level)
        for log, (handlers, propagate, disabled) in zip(uvicorns, saved, strict=True):
            log.handlers, log.propagate, log.disabled = handlers, propagate, disabled


class _QuotingTokenizer(CharTokenizer):
    """Fails on every prompt with an error that quotes it, as tokenizers' errors do."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise ValueError(f"cannot encode {text!r}") from KeyError(text)


class _QuotingEngine(ScriptedEngine):
    """Refuses every request with an error that quotes its prompt."""

    def add_request(self, request_id, prompt_token_ids, params, priority=0, cache_salt=None):
        raise RuntimeError(f"cannot take {self.tokenizer.decode(prompt_token_ids)!r}")


@pytest.mark.parametrize("log_prompts", [False, True])
@pytest.mark.parametrize("log_format", ["text", "json"])
def test_a_failing_request_logs_where_it_failed_but_its_text_only_when_asked(
    log_prompts, log_format
):
    """Two failures whose exceptions quote the prompt: the tokenizer's (an unexpected error
    on the event loop's side) and the engine's (on the engine thread)."""
    body = {"model": "m", "prompt": f"my {SECRET}", "max_tokens": 2}
    for engine in (ScriptedEngine(["x"], _QuotingTokenizer()), _QuotingEngine(["x"])):
        with logged_server(engine, log_prompts, log_format) as (url, log):
            answer = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
            assert answer.status_code == 500 and SECRET not in answer.text
        logged = log.getvalue()
        kind = "ValueError" if isinstance(engine.tokenizer, _QuotingTokenizer) else "RuntimeError"
        assert kind in logged and "Traceback" in logged, logged  # what failed, and where
        assert "test_server_logs.py" in logged  # the frame that raised
        assert (SECRET in logged) == log_prompts, logged


def test_a_withheld_traceback_keeps_the_types_and_frames_of_the_whole_chain():
    try:
        try:
            raise KeyError(SECRET)
        except KeyError as exc:
            raise ValueError(SECRET) from exc
    except ValueError as exc:
        text = withheld_traceback(exc)
    assert SECRET not in text
    assert text.index("KeyError: (message withheld") < text.index("ValueError: (message")
    assert "direct cause" in text and text.count('File "') == 2
    assert "in test_a_withheld_traceback_keeps" in text


FORGED_IDS = [
    b"a] FAKE LINE [b",  # brackets and spaces: a text line's id field closed early
    b"a\r\n ] FAKE LINE [",  # folded onto a second header line (obsolete line folding)
    b"a\n] FAKE LINE [",  # a bare newline
    b"a\xe2\x80\xa8] FAKE LINE [",  # U+2028 (a line separator to some log viewers)
    b'a", "level": "FAKE LINE',  # a JSON line's field closed early
]


def _raw_post(url: str, request_id: bytes) -> bytes:
    """A completions request with this X-Request-Id, sent as raw bytes (clients refuse to
    send most of these); the whole reply."""
    body = b'{"model": "m", "prompt": "hi", "max_tokens": 2}'
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
        b"Content-Type: application/json\r\nX-Request-Id: " + request_id + b"\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=30) as sock:
        sock.sendall(head + body)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    return reply


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_a_forged_request_id_never_reaches_the_log(log_format):
    with logged_server(ScriptedEngine(["x"]), log_format=log_format) as (url, log):
        replies = [_raw_post(url, forged) for forged in FORGED_IDS]
        health = httpx.get(f"{url}/health", headers={"X-Request-Id": "a] FAKE LINE [b"})
    assert health.headers["x-request-id"].startswith("req-")
    for forged, reply in zip(FORGED_IDS, replies, strict=True):
        status = reply.split(b"\r\n", 1)[0]
        assert status in (b"HTTP/1.1 200 OK", b"HTTP/1.1 400 Bad Request"), (forged, reply)
        if status.endswith(b"200 OK"):
            assert b"\r\nx-request-id: req-" in reply, (forged, reply)
    logged = log.getvalue()
    assert "ended (stop)" in logged and "POST /v1/completions" in logged  # lines were written
    assert "FAKE" not in logged, logged
