"""One request's parameters must never fail another's: requests that once broke the engine
step for everyone, sent while a victim stream runs on the real engine."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
from fake_engine import CharTokenizer, ScriptedEngine
from server_helpers import running_app, running_server, small_engine
from tiny_server import tiny_engine
from victim import GAP_BOUND_S, Victim

from server.app import HttpOptions, build_app
from server.async_engine import AsyncEngine
from server.http.connections import server_protocol
from server.http.limits import MAX_LOGIT_BIAS

HUGE_TOP_K = 2**40  # past int32: it was an OverflowError on the engine thread
QUESTION = [{"role": "user", "content": "Count from one to twenty."}]


def test_a_huge_top_k_ends_well_and_spares_the_other_streams(default_model_dir):
    """A top_k past int32 once raised on the engine thread and failed every request in the
    step. Sent on each API while a victim streams (its first token already out), it ends
    well, and the victim's gaps and /health stay under the bound."""
    attacks = [
        ("/v1/chat/completions", {"messages": QUESTION}),
        ("/v1/completions", {"prompt": "One, two,"}),
        ("/v1/messages", {"messages": QUESTION}),
    ]
    with running_server(small_engine(default_model_dir, 512)) as url, Victim(url) as victim:
        answers = [
            httpx.post(f"{url}{path}", timeout=120,
                       json={"model": "m", "max_tokens": 4, "top_k": HUGE_TOP_K, **fields})
            for path, fields in attacks
        ]  # fmt: skip
        overlapped = victim.finish_reason is None  # still streaming once the attacks ended
    assert [a.status_code for a in answers] == [200, 200, 200], [a.text for a in answers]
    assert overlapped, "the victim's stream ended before the attacks did"
    assert victim.max_gap < GAP_BOUND_S and victim.max_health < GAP_BOUND_S, (
        victim.max_gap, victim.max_health)


def _asked(arguments: str) -> list[dict]:
    """A conversation in which the assistant called f with these arguments."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"}]  # fmt: skip


def _called(arguments: str) -> list[dict]:
    """The same conversation as Responses input items."""
    return [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": arguments},
            {"type": "function_call_output", "call_id": "c1", "output": "ok"}]  # fmt: skip


# (path, body, the param its 400 names). json.dumps writes each lone surrogate as the JSON
# escape "\ud800" a client sends; '\\ud800' is that escape inside a tool call's JSON text.
LONE_SURROGATE = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi \ud800 there"}]},
     "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "us\udc00er", "content": "hi"}]},
     "messages[0].role"),
    ("/v1/chat/completions", {"messages": _asked('{"a": "\ud800"}')},
     "messages[1].tool_calls[0].function.arguments"),
    ("/v1/chat/completions", {"messages": _asked('{"a": "\\ud800"}')},
     "messages[1].tool_calls[0].function.arguments"),
    ("/v1/completions", {"prompt": "\udfff"}, "prompt"),
    ("/v1/completions", {"prompt": ["ok", "\udfff"]}, "prompt[1]"),
    ("/v1/responses", {"input": "hi \ud800"}, "input"),
    ("/v1/responses", {"input": "hi", "instructions": "be \udfff brief"}, "instructions"),
    ("/v1/responses", {"input": _called('{"a": "\\udbff"}')}, "input[0].arguments"),
    ("/v1/messages", {"messages": [{"role": "user", "content": [{"type": "text",
                                                                 "text": "\ud800"}]}]}, None),
]  # fmt: skip


def test_a_lone_surrogate_is_a_400_naming_the_field(default_model_dir):
    """JSON's \\ud800 escape decodes to text the tokenizer refuses; that was a 500 whose body
    was the exception's repr. Escaped inside a tool call's arguments, it is the same text
    once they are parsed for the template."""
    with running_server(small_engine(default_model_dir, 256)) as url:
        answers = [
            httpx.post(f"{url}{path}", timeout=60, headers={"content-type": "application/json"},
                       content=json.dumps({"model": "m", "max_tokens": 4,
                                           "max_output_tokens": 4, **fields}))
            for path, fields, _ in LONE_SURROGATE
        ]  # fmt: skip
        after = httpx.post(f"{url}/v1/completions", timeout=60,
                           json={"model": "m", "prompt": "One,", "max_tokens": 2})  # fmt: skip
    for answer, (path, _, param) in zip(answers, LONE_SURROGATE, strict=True):
        assert answer.status_code == 400, (path, param, answer.text)
        error = answer.json()["error"]
        assert "lone UTF-16 surrogate" in error["message"], (param, error)
        assert error.get("param", param) == param, (param, error)
        assert param is None or error["message"].startswith(f"Invalid request: {param}: ")
    assert after.status_code == 200


SECRET = "my secret PIN 1234"


class _LeakyTokenizer(CharTokenizer):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise RuntimeError(f"cannot encode {text!r}")


class _LeakyAddEngine(ScriptedEngine):
    """Refuses every request with an error that quotes its prompt."""

    def add_request(self, request_id, prompt_token_ids, params, priority=0, cache_salt=None):
        raise RuntimeError(f"cannot take {self.tokenizer.decode(prompt_token_ids)!r}")


class _LeakyStepEngine(ScriptedEngine):
    """Says its first piece, then fails the step with an error that quotes the prompt."""

    def step(self):
        if any(sent for _, sent in self.live.values()):
            raise RuntimeError(f"the step broke on {list(self.prompts.values())!r}")
        return super().step()


# Each API's request and where its body's error message is, one stream-less, one streamed.
LEAK_REQUESTS = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": SECRET}]}),
    ("/v1/completions", {"prompt": SECRET}),
    ("/v1/responses", {"input": SECRET}),
    ("/v1/messages", {"messages": [{"role": "user", "content": SECRET}]}),
]


def test_a_500_body_says_nothing_of_the_request():
    engine = ScriptedEngine(["Hi"], _LeakyTokenizer())
    with running_server(engine) as url:
        answer = httpx.post(f"{url}/v1/completions", timeout=30,
                            json={"model": "m", "prompt": SECRET})  # fmt: skip
    assert answer.status_code == 500
    assert "1234" not in answer.text and "server log" in answer.json()["error"]["message"]


@pytest.mark.parametrize("engine_class", [_LeakyAddEngine, _LeakyStepEngine])
def test_an_engine_failure_tells_no_client_its_prompt(engine_class):
    """The engine's error (which may quote the prompt) reaches the log, not the client: a
    generic 500 in each API's shape, or a generic error event once a stream began."""
    with running_server(engine_class(["Hello", " there"])) as url:
        for path, fields in LEAK_REQUESTS:
            body = {"model": "m", "max_tokens": 8, **fields}
            whole = httpx.post(f"{url}{path}", json=body, timeout=30)
            assert whole.status_code == 500, (path, whole.text)
            assert "1234" not in whole.text, (path, whole.text)
            error = whole.json()["error"]
            assert "server log has the details" in error["message"], (path, error)
            assert error["type"] == ("api_error" if path == "/v1/messages" else "server_error")
            streamed = httpx.post(f"{url}{path}", json={**body, "stream": True}, timeout=30)
            assert "1234" not in streamed.text, (path, streamed.text)
            assert "server log has the details" in streamed.text, (path, streamed.text)


def test_logit_bias_floods_are_refused_and_full_ones_spare_the_others(default_model_dir):
    """400k keys once made one request take 28 s and stalled every stream. Now a flood is
    refused before it is parsed, and requests at the 1024-entry cap leave the victim's gaps
    under the bound."""
    full = {str(i): -1 for i in range(MAX_LOGIT_BIAS)}
    # Encoded up front: the client shares the server's process (and its GIL) here.
    flood = json.dumps({"model": "m", "prompt": "One,", "max_tokens": 16,
                        "logit_bias": {str(i): -1 for i in range(400_000)}}).encode()
    headers = {"Content-Type": "application/json"}
    with running_server(small_engine(default_model_dir, 512)) as url, Victim(url) as victim:
        refused = httpx.post(f"{url}/v1/completions", timeout=60, content=flood, headers=headers)
        answers = _in_parallel(4, lambda: httpx.post(f"{url}/v1/completions", timeout=120, json={
            "model": "m", "prompt": "One,", "max_tokens": 16, "logit_bias": full}))  # fmt: skip
    assert refused.status_code == 413 and "JSON values" in refused.json()["error"]["message"]
    assert all(a.status_code == 200 for a in answers), [a.text[:200] for a in answers]
    assert victim.max_gap < GAP_BOUND_S and victim.max_health < GAP_BOUND_S, (
        victim.max_gap, victim.max_health)


def test_trickling_clients_spare_the_others(default_model_dir):
    """Forty connections that trickle their headers and bodies hold no request slot for
    long and slow no one down; each is cut off at the client timeout."""
    engine = small_engine(default_model_dir, 512)
    app = build_app(AsyncEngine(engine), "m", options=HttpOptions(client_timeout_s=1.0))
    with running_app(app, http=server_protocol(1.0, 1024)) as url, Victim(url) as victim:
        port = int(url.rsplit(":", 1)[1])
        socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(40)]
        for i, sock in enumerate(socks):
            head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            sock.sendall(head + (b"Content-Length: 500\r\n\r\n{" if i % 2 else b"X-A: "))
        deadline = time.monotonic() + 8
        open_socks = list(socks)
        while open_socks and time.monotonic() < deadline:
            for sock in list(open_socks):
                try:
                    sock.sendall(b" ")
                except OSError:
                    open_socks.remove(sock)
            time.sleep(0.1)
        for sock in socks:
            sock.close()
    assert not open_socks, f"{len(open_socks)} trickling connections were never cut off"
    assert victim.max_gap < GAP_BOUND_S and victim.max_health < GAP_BOUND_S, (
        victim.max_gap, victim.max_health)


def _metric(url: str, name: str, label: str = "") -> float:
    """The value of the series `name` (whose labels hold `label`) on the server's /metrics."""
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith(name + "{") and label in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {label} is not on /metrics")


def _aborted(url: str) -> float:
    return _metric(url, "vllm:request_success_total", 'finished_reason="abort"')


# Choices of the stream nobody reads: ~10 MB of SSE, far past every buffer on the way, and
# with the victim within the engine's 64 running sequences (all must start before the head).
NUM_UNREAD = 32


def test_a_stream_nobody_reads_is_aborted_and_frees_its_blocks(tmp_path):
    """A client that asks for a big stream (32 choices, 20 logprobs a token) with a tiny
    receive buffer and never reads it fills every buffer between it and the server; the
    server's next write then waits. Within --client-timeout of that the server treats it as
    gone: every choice is aborted (not run to its length) and its KV blocks freed, while a
    victim stream on the same engine keeps its pace."""
    # The victim's 1000 tokens outlast the drop (about 2 s) on a fast machine too.
    app = build_app(AsyncEngine(tiny_engine(tmp_path, max_model_len=1100)), "m", NUM_UNREAD,
                    options=HttpOptions(client_timeout_s=1.0))  # fmt: skip
    body = json.dumps({
        "model": "m", "messages": [{"role": "user", "content": "w3 w4"}], "max_tokens": 200,
        "ignore_eos": True, "n": NUM_UNREAD, "logprobs": True, "top_logprobs": 20,
        "stream": True,
    }).encode()  # fmt: skip
    with running_app(app) as url:
        with Victim(url, max_tokens=1000) as victim:
            sock = _unread_stream(url, body)
            head = sock.recv(256)  # the status line; from here on nothing is read
            stopped = time.monotonic()
            deadline = stopped + 20
            while _aborted(url) < NUM_UNREAD:
                assert time.monotonic() < deadline, f"{_aborted(url)} choices aborted in 20 s"
                time.sleep(0.1)
            took = time.monotonic() - stopped
            overlapped = victim.finish_reason is None
        sock.close()
        deadline = time.monotonic() + 10
        while _metric(url, "vllm:kv_cache_usage_perc") != 0.0:  # the victim's ended too
            assert time.monotonic() < deadline, "KV blocks are still held"
            time.sleep(0.1)
        lengths = _metric(url, "vllm:request_success_total", 'finished_reason="length"')
    assert head.startswith(b"HTTP/1.1 200"), head
    assert lengths == 1  # the victim's; no unread choice ran to its end
    assert overlapped, "the victim's stream ended before the unread one was dropped"
    assert took < 10, took  # filling the buffers, then the 1 s timeout, on a busy machine
    assert victim.max_gap < GAP_BOUND_S and victim.max_health < GAP_BOUND_S, (
        victim.max_gap, victim.max_health)


def _unread_stream(url: str, body: bytes) -> socket.socket:
    """A connection that posts `body` to chat completions with a 4 KiB receive buffer (set
    before connecting: it sizes the window the server may fill)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", int(url.rsplit(":", 1)[1])))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 b"Content-Type: application/json\r\nContent-Length: "
                 + str(len(body)).encode() + b"\r\n\r\n" + body)  # fmt: skip
    return sock


def _in_parallel(count: int, call):
    results: list = [None] * count

    def run(index: int) -> None:
        results[index] = call()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    return results


def test_a_schema_that_takes_seconds_to_compile_spares_the_other_streams(default_model_dir):
    """A pattern like this one takes seconds to compile (and then fails); compiled on the
    engine thread, it stalled every stream that long, once per distinct schema."""
    schema = {"type": "object", "required": ["a"],
              "properties": {"a": {"type": "string", "pattern": "^a{1000}{1000}$"}}}
    format_ = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    with running_server(small_engine(default_model_dir, 512)) as url:
        # The first grammar of a process builds the tokenizer's grammar view (~1 s, once).
        first = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
            "model": "m", "messages": QUESTION, "max_tokens": 4,
            "response_format": {"type": "json_object"}})  # fmt: skip
        assert first.status_code == 200
        with Victim(url) as victim:
            refused = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
                "model": "m", "messages": QUESTION, "max_tokens": 8, "response_format": format_})
    assert refused.status_code == 400 and "response_format" in refused.json()["error"]["message"]
    assert victim.max_gap < GAP_BOUND_S and victim.max_health < GAP_BOUND_S, (
        victim.max_gap, victim.max_health)
