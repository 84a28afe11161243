"""`/metrics` on a real server (the real engine over a tiny random model): it parses as
Prometheus text, and its counters and histograms move with the requests served."""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import running_app
from tiny_server import tiny_engine

from server.app import build_app
from server.async_engine import AsyncEngine


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    engine = tiny_engine(tmp_path_factory.mktemp("tiny-llama"))
    with running_app(build_app(AsyncEngine(engine))) as url:
        yield engine, url


def scrape(url: str) -> dict[str, float]:
    """Every sample by name and labels, e.g. `metal_serve_requests_total{finish_reason=length}`."""
    response = httpx.get(f"{url}/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


def test_counters_and_histograms_move_with_requests(served):
    engine, url = served
    before = scrape(url)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    prompt = list(range(3, 43))  # two full blocks and a bit
    for _ in range(2):  # the second finds the prompt's full blocks cached
        reply = client.completions.create(model="m", prompt=prompt, max_tokens=5)
    after = scrape(url)

    def moved(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert moved("metal_serve_requests_total{finish_reason=length}") == 2
    assert moved("metal_serve_prompt_tokens_total") == 2 * reply.usage.prompt_tokens
    assert moved("metal_serve_generation_tokens_total") == 10
    assert moved("metal_serve_time_to_first_token_seconds_count") == 2
    assert moved("metal_serve_e2e_request_latency_seconds_count") == 2
    assert moved("metal_serve_inter_token_latency_seconds_count") == 2 * 4
    assert moved("metal_serve_prefix_cache_hit_tokens_total") == 32
    assert 0 < after["metal_serve_prefix_cache_hit_rate"] <= 1
    pool = engine.scheduler.pool
    assert after["metal_serve_kv_cache_blocks"] == pool.num_blocks
    assert after["metal_serve_requests_running"] == after["metal_serve_requests_waiting"] == 0
    assert after["metal_serve_preemptions_total"] == engine.scheduler.num_preemptions


def test_refused_requests_are_counted_as_rejected(served):
    _, url = served
    before = scrape(url).get("metal_serve_requests_total{finish_reason=rejected}", 0.0)
    body = {"prompt": [10**9], "max_tokens": 2}  # an id the vocabulary does not have
    assert httpx.post(f"{url}/v1/completions", json=body).status_code == 400
    body = {"prompt": "hi", "max_tokens": 2, "priority": 3}  # needs the priority policy
    assert httpx.post(f"{url}/v1/completions", json=body).status_code == 400
    after = scrape(url)["metal_serve_requests_total{finish_reason=rejected}"]
    assert after - before == 1  # the token-id check never reached the engine
