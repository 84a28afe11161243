"""`metal-serve status` against live servers over the tiny model: the running requests and
pool usage, `--watch`, and one clear line (no traceback) for each way it can fail."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dashboard_helpers import complete, state, streaming_completion, tiny_dashboard_server
from fastapi import FastAPI
from server_helpers import running_app

from server.cli import main
from server.dashboard.status_cli import base_url
from server.dashboard.status_text import format_status


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    with tiny_dashboard_server(tmp_path_factory.mktemp("tiny")) as base:
        yield base


@pytest.fixture(scope="module")
def keyed_url(tmp_path_factory):
    with tiny_dashboard_server(tmp_path_factory.mktemp("tiny-keyed"), api_keys=("k1",)) as base:
        yield base


def status(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["status", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_status_prints_the_running_requests_and_pool_usage(url, capsys):
    with streaming_completion(url) as request_id:
        code, out, err = status(capsys, "--url", url)
        kv = state(url)["kv_cache"]
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0].startswith(f"metal-serve at {url}: tiny (")
    assert any(line.startswith("requests") and " running, " in line for line in lines)
    kv_line = next(line for line in lines if line.startswith("kv cache"))
    used, total = kv_line.split()[2], kv_line.split()[4]
    assert int(total.replace(",", "")) == kv["blocks_total"] and int(used.replace(",", "")) > 0
    header = next(i for i, line in enumerate(lines) if line.startswith("REQUEST"))
    row = next(line for line in lines[header + 1:] if line.startswith(request_id)).split()
    assert row[1:3] == ["completions", "running"] and row[7] == "40"  # the prompt's tokens


def test_status_when_idle_and_after_requests(url, capsys):
    complete(url, max_tokens=5)
    code, out, _ = status(capsys, "--url", f"{url}/v1/")  # a pasted base_url works too
    assert code == 0 and out.rstrip().endswith("no requests in flight")
    totals = state(url)["totals"]
    assert f"length {totals['requests_finished']['length']:,}" in out
    assert f"{totals['generation_tokens']:,} generated" in out


def test_status_watch_redraws_until_interrupted(url):
    command = [str(Path(sys.executable).parent / "metal-serve"), "status", "--url", url,
               "--watch", "--interval", "0.2"]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        frames, deadline = 0, time.monotonic() + 30
        while frames < 2 and time.monotonic() < deadline:
            frames += process.stdout.readline().startswith("metal-serve at ")
        assert frames == 2
    finally:
        process.send_signal(2)  # Ctrl-C
        out, _ = process.communicate(timeout=10)
    assert process.returncode == 0 and "Traceback" not in out


def test_status_with_a_key(keyed_url, capsys, monkeypatch):
    code, out, _ = status(capsys, "--url", keyed_url, "--api-key", "k1")
    assert code == 0 and out.startswith("metal-serve at")
    monkeypatch.setenv("METAL_SERVE_API_KEY", "k1")
    assert main(["status", "--url", keyed_url]) == 0


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("case", ["no key", "wrong key", "down", "bad url", "not metal-serve",
                                  "bad port", "bad interval"])  # fmt: skip
def test_status_failures_are_one_line_naming_the_fix(case, keyed_url, capsys, monkeypatch):
    monkeypatch.delenv("METAL_SERVE_API_KEY", raising=False)
    with running_app(FastAPI()) as other:  # answers 404 to everything
        args, want_code, wanted = {
            "no key": (["--url", keyed_url], 1, "needs an API key: pass --api-key"),
            "wrong key": (["--url", keyed_url, "--api-key", "nope"], 1, "refused the API key"),
            "down": (["--url", f"http://127.0.0.1:{closed_port()}"], 1,
                     "(connection refused): start one with `metal-serve serve`"),
            "bad url": (["--url", "127.0.0.1:8000"], 2, "is not an http(s) URL"),
            "not metal-serve": (["--url", other], 1, "is --url a metal-serve server"),
            "bad port": (["--url", "http://127.0.0.1:80x"], 2, "has a bad port"),
            "bad interval": (["--url", keyed_url, "--interval", "0"], 2, "must be positive"),
        }[case]  # fmt: skip
        code, out, err = status(capsys, *args)
    assert (code, out) == (want_code, "")
    assert err.startswith("metal-serve status: error: ") and wanted in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_a_hybrid_and_drafting_server_shows_slots_and_acceptance(url):
    doc = state(url)
    doc["state_slots"] = {"total": 64, "used": 3}
    doc["speculative"] = {"drafts": 10, "draft_tokens": 30, "accepted_tokens": 12,
                          "acceptance_rate": 0.4, "mean_acceptance_length": 2.2,
                          "accepted_per_position": [6, 4, 2],
                          "by_method": {"ngram": {"draft_tokens": 20, "accepted_tokens": 10},
                                        "suffix": {"draft_tokens": 10, "accepted_tokens": 2}},
                          "speedup_estimate": 1.234}  # fmt: skip
    text = format_status(doc, url)
    assert "state slots  3 / 64 in use" in text
    assert ("speculative  40.0% of 30 draft tokens accepted, 2.20 tokens per draft step; "
            "ngram 10/20; suffix 2/10; ~1.23x estimated") in text


def test_base_url_keeps_a_path_prefix():
    assert base_url("https://host:8443/serve/v1") == "https://host:8443/serve"
    assert base_url(" http://127.0.0.1:8000/ ") == "http://127.0.0.1:8000"
