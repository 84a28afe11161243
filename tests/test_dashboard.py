"""`/dashboard/state` on a real server over the tiny random model: what it says of a streaming
request, that it agrees with /metrics, that it needs the API key, that prompt text shows only
under --log-prompts; the page ships its own assets; the charts' intervals."""

from __future__ import annotations

import json
import re
import time
from types import SimpleNamespace

import httpx
import mlx.core as mx
import pytest
from dashboard_helpers import (
    LONG_STREAM_TOKENS,
    complete,
    lookup,
    metrics_view,
    scrape,
    state,
    streaming_completion,
    tiny_dashboard_server,
    wait_for,
)
from server_helpers import running_app
from tiny_models import build_tiny_model
from tiny_server import CHAT_TEMPLATE

from kernels_metal import attention
from metal_engine.config import EngineConfig
from metal_engine.engine_build import build_engine
from metal_engine.outputs import EngineStats, RequestOutput
from scheduler.spec_decode.config import SpeculativeConfig
from scheduler.stats import RequestState
from server.app import build_app
from server.async_engine import AsyncEngine, LiveRequest
from server.dashboard import SCHEMA
from server.dashboard.history import INTERVAL_S, NUM_INTERVALS, RecentActivity
from server.dashboard.state import requests_section
from server.dashboard.status_text import format_status

SECTIONS = {"schema", "time", "uptime_s", "model", "requests", "kv_cache", "state_slots",
            "prefix_cache", "totals", "recent", "history", "speculative", "memory",
            "kernels"}  # fmt: skip
SVG_NAMESPACE = "http://www.w3.org/2000/svg"  # a name, never fetched
ROW_FIELDS = {"id", "http_request_id", "api", "status", "age_s", "ttft_s", "prompt_tokens",
              "cached_tokens", "computed_tokens", "generated_tokens", "preemptions",
              "draft_tokens", "accepted_draft_tokens"}  # fmt: skip


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    with tiny_dashboard_server(tmp_path_factory.mktemp("tiny")) as base:
        yield base


def test_state_shows_a_streaming_request(url):
    with streaming_completion(url) as request_id:
        doc = state(url)
    assert doc["schema"] == SCHEMA and set(doc) == SECTIONS
    assert doc["model"] == {"served_name": "tiny", "name": doc["model"]["name"],
                            "max_model_len": 4096}  # fmt: skip
    (row,) = [row for row in doc["requests"]["list"] if row["id"] == request_id]
    assert set(row) == ROW_FIELDS  # no prompt text without --log-prompts
    assert (row["api"], row["status"]) == ("completions", "running")
    assert doc["requests"]["running"] >= 1
    assert 0 < row["generated_tokens"] < LONG_STREAM_TOKENS and row["prompt_tokens"] == 40
    assert row["computed_tokens"] >= row["prompt_tokens"] + row["generated_tokens"] - 1
    assert 0 < row["ttft_s"] <= row["age_s"]
    kv = doc["kv_cache"]
    assert 0 < kv["blocks_used"] < kv["blocks_total"] and kv["block_size"] == 16
    assert kv["usage"] == pytest.approx(kv["blocks_used"] / kv["blocks_total"])
    assert doc["state_slots"] is None and doc["speculative"] is None
    assert doc["memory"]["process_rss_bytes"] > 0


def test_a_finished_request_leaves_the_list_and_counts_in_the_totals(url):
    before = state(url)["totals"]
    complete(url, max_tokens=8)
    doc = state(url)
    assert doc["requests"]["list"] == [] and doc["requests"]["running"] == 0
    finished = doc["totals"]["requests_finished"]
    assert finished["length"] == before["requests_finished"]["length"] + 1
    assert doc["totals"]["generation_tokens"] == before["generation_tokens"] + 8


def test_state_agrees_with_metrics_when_idle(url):
    complete(url)
    complete(url)  # the same prompt again: its two full blocks are a prefix-cache hit
    doc, samples = state(url), scrape(url)
    assert doc["prefix_cache"]["hit_tokens"] >= 32
    for path, value in metrics_view(samples).items():
        assert lookup(doc, path) == pytest.approx(value), path


def test_kernel_fallbacks_show_in_the_state_the_status_and_metrics(url, monkeypatch):
    dispatch = attention._Dispatch()  # verdicts as a Mac would have them after a failure
    variant = attention.Variant(mx.float16, 128, 16, 8, 2)
    dispatch.verdicts.fallbacks[variant] = "ValueError: Thread group size (1024) is greater"
    monkeypatch.setattr(attention, "_state", dispatch)
    doc, samples = state(url), scrape(url)
    assert doc["kernels"]["fallbacks"] == [{"kernel": "attention", "variant": variant.name,
                                            "reason": dispatch.verdicts.fallbacks[variant]}]
    key = f"metal_serve_kernel_fallbacks_total{{kernel=attention,variant={variant.name}}}"
    assert samples[key] == 1
    assert ("kernels      1 fallbacks; attention float16-d128-bs16-h8kv2: ValueError: Thread "
            "group size (1024) is greater") in format_status(doc, url).splitlines()


def test_each_api_is_named(url):
    bodies = {
        "/v1/chat/completions": ("chat", {"messages": [{"role": "user", "content": "w5"}],
                                          "max_tokens": LONG_STREAM_TOKENS}),
        "/v1/completions": ("completions", {"prompt": "w5 w6", "max_tokens": LONG_STREAM_TOKENS}),
        "/v1/responses": ("responses", {"input": "w5", "max_output_tokens": LONG_STREAM_TOKENS}),
        "/v1/messages": ("anthropic", {"messages": [{"role": "user", "content": "w5"}],
                                       "max_tokens": LONG_STREAM_TOKENS}),
    }  # fmt: skip
    with httpx.Client(base_url=url, timeout=30) as client:
        for path, (api, body) in bodies.items():
            payload = {"model": "tiny", "stream": True, **body}
            with client.stream("POST", path, json=payload) as response:
                assert response.status_code == 200
                lines = response.iter_lines()  # dropping it would close the stream
                next(lines)  # a stream's head may come before its request starts
                rows = wait_for(lambda: state(url)["requests"]["list"])
            # An aborted one may linger a moment: the newest is this one.
            assert min(rows, key=lambda row: row["age_s"])["api"] == api, path


def test_state_needs_an_api_key_the_page_does_not(tmp_path):
    with tiny_dashboard_server(tmp_path, api_keys=("secret",)) as base:
        page = httpx.get(f"{base}/dashboard")
        assert page.status_code == 200 and 'data-needs-key="true"' in page.text
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": "wrong"}):
            response = httpx.get(f"{base}/dashboard/state", headers=headers)
            assert response.status_code == 401, headers
            assert response.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{base}/dashboard/state", headers={"x-api-key": "secret"}).is_success
        assert state(base, api_key="secret")["schema"] == SCHEMA


def test_prompt_text_shows_only_with_log_prompts(tmp_path):
    with (tiny_dashboard_server(tmp_path, log_prompts=True) as base,
          streaming_completion(base, prompt=[11, 12]) as request_id):
        (row,) = [r for r in state(base)["requests"]["list"] if r["id"] == request_id]
    assert row["prompt"] == "w11 w12"


def test_a_keys_prompt_text_shows_to_that_key_only(tmp_path):
    with (tiny_dashboard_server(tmp_path, api_keys=("k1", "k2"), log_prompts=True) as base,
          streaming_completion(base, prompt=[11, 12], api_key="k1") as request_id):
        mine, theirs = ([r for r in state(base, key)["requests"]["list"] if r["id"] == request_id]
                        for key in ("k1", "k2"))  # fmt: skip
    assert mine[0]["prompt"] == "w11 w12"
    assert "prompt" not in theirs[0] and theirs[0]["prompt_tokens"] == 2


def test_page_and_assets_ship_in_the_package_under_a_strict_policy(url):
    page = httpx.get(f"{url}/dashboard")
    assert page.headers["content-type"].startswith("text/html")
    assert 'data-needs-key="false"' in page.text
    policy = page.headers["content-security-policy"]
    assert "default-src 'none'" in policy and "script-src 'self'" in policy
    assets = re.findall(r'(?:src|href)="(/[^"]+)"', page.text)
    assert sorted(assets) == ["/dashboard/dashboard.css", "/dashboard/dashboard.js"]
    for asset in assets:
        response = httpx.get(f"{url}{asset}")
        assert response.status_code == 200
        urls = set(re.findall(r"https?://[^\s\"']+", response.text))
        assert urls <= {SVG_NAMESPACE}, urls  # nothing from a CDN
    assert "/dashboard" not in httpx.get(f"{url}/openapi.json").text


def test_speculative_acceptance_shows_when_drafting(tmp_path):
    build_tiny_model("llama", tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    spec = SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 3, '
                                       '"prompt_lookup_min": 1, "prompt_lookup_max": 2}')
    drafting = build_engine(EngineConfig(
        model_dir=tmp_path, max_model_len=256, kv_cache_memory=16 << 20, speculative_config=spec,
    ))  # fmt: skip
    with running_app(build_app(AsyncEngine(drafting), "tiny")) as base:
        complete(base, prompt=[5, 6, 7, 5, 6, 7, 5, 6], max_tokens=64)
        doc, samples = state(base), scrape(base)
    spec_state = doc["speculative"]
    assert spec_state["draft_tokens"] == samples["vllm:spec_decode_num_draft_tokens_total"]
    assert spec_state["accepted_tokens"] == samples["vllm:spec_decode_num_accepted_tokens_total"]
    assert spec_state["drafts"] == samples["vllm:spec_decode_num_drafts_total"]
    assert spec_state["draft_tokens"] > 0
    assert spec_state["by_method"] == {"ngram": {"draft_tokens": spec_state["draft_tokens"],
                                                 "accepted_tokens": spec_state["accepted_tokens"]}}
    assert spec_state["speedup_estimate"] == pytest.approx(
        samples["metal_serve:spec_decode_speedup_estimate"])


def test_hybrid_models_report_their_state_slots(tiny_hybrid):
    engine = build_engine(EngineConfig(
        model_dir=tiny_hybrid[1], max_model_len=256, kv_cache_memory=16 << 20
    ))  # fmt: skip
    stats = engine.stats()
    assert stats.num_state_slots >= engine.scheduler.config.max_num_seqs
    assert stats.num_used_state_slots == 0 and stats.requests == ()


# ---- the charts' intervals -----------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_intervals_close_into_points_with_their_rates_and_percentiles():
    clock = Clock()
    recent = RecentActivity(clock)
    recent.add(clock.now, 1, ttft=0.2)
    recent.add(clock.now + 1, 4, itl=0.01)
    recent.add(clock.now + 2, 5, itl=0.03)
    assert recent.points() == []  # the first interval is still open
    clock.now += 2 * INTERVAL_S
    first, empty = recent.points()
    assert first["output_tokens_per_s"] == 10 / INTERVAL_S
    assert first["ttft_s"] == {"p50": 0.2, "p90": 0.2, "p99": 0.2}
    assert first["itl_s"]["p50"] == pytest.approx(0.03) and first["itl_s"]["p90"] == 0.03
    assert empty == {"t": empty["t"], "output_tokens_per_s": 0.0, "ttft_s": None, "itl_s": None}
    assert empty["t"] - first["t"] == pytest.approx(INTERVAL_S)
    summary = recent.summary()
    assert summary["output_tokens_per_s"] == 0.0  # the newest closed interval was idle
    assert summary["ttft_s"]["p50"] == 0.2 and summary["itl_s"]["p99"] == pytest.approx(0.03)


def test_only_the_window_is_kept():
    clock = Clock()
    recent = RecentActivity(clock)
    recent.add(clock.now, 3, ttft=0.5)
    clock.now += (NUM_INTERVALS + 3) * INTERVAL_S
    recent.add(clock.now, 1, ttft=0.1)
    points = recent.points()
    assert len(points) == NUM_INTERVALS and all(p["ttft_s"] is None for p in points)
    assert recent.summary()["ttft_s"] is None  # the last minute's closed intervals were idle


def test_rows_say_whether_the_scheduler_runs_holds_or_has_not_seen_a_request():
    def live(request_id, age_s, finished=False):
        last = RequestOutput(request_id, [], "", "length" if finished else None, 7, 3)
        return LiveRequest(request_id, "req", time.monotonic() - age_s, 7, last=last)

    engine = SimpleNamespace(report_cached_tokens=True, live_requests=lambda: [
        live("cmpl-queued", 0.1), live("msg_waiting", 2.0), live("resp_running", 1.0),
        live("chatcmpl-done", 3.0, finished=True),
    ])  # fmt: skip
    stats = EngineStats(num_running=1, num_waiting=1, requests=(
        RequestState("resp_running", True, 10, 4, 0), RequestState("msg_waiting", False, 0, 0, 1),
    ))  # fmt: skip
    requests = requests_section(stats, engine)
    rows = [(r["id"], r["status"], r["computed_tokens"]) for r in requests["list"]]
    assert rows == [("resp_running", "running", 10), ("msg_waiting", "waiting", 0),
                    ("cmpl-queued", "queued", 0)]  # fmt: skip
    assert (requests["running"], requests["waiting"], requests["queued"]) == (1, 1, 1)
