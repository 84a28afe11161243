"""`/metrics` on a real server (the real engine over a tiny random model): it parses as
Prometheus text, under vLLM v1's names, types and labels, and its numbers move with the
requests served."""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import running_app
from tiny_models import build_tiny_model

from metal_engine.config import EngineConfig
from metal_engine.engine import LLMEngine
from metal_engine.engine_build import build_engine
from scheduler import SamplingParams
from server.app import build_app
from server.async_engine import AsyncEngine
from server.http.metrics import ServerMetrics

MODEL = "tiny"
PROMPT = list(range(3, 43))  # two full blocks of 16 and a bit
VLLM_TYPES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    build_tiny_model("llama", path)
    return path


def make_engine(model_dir, **config) -> LLMEngine:
    return build_engine(EngineConfig(
        model_dir=model_dir, max_model_len=256, kv_cache_memory=16 << 20, **config
    ))  # fmt: skip


@pytest.fixture(scope="module")
def served(model_dir):
    engine = make_engine(model_dir)
    with running_app(build_app(AsyncEngine(engine), MODEL)) as url:
        yield engine, url


def parse(text: str) -> tuple[dict[str, str], dict[str, float]]:
    """Family types by name, and samples by name and labels, e.g.
    `vllm:request_success_total{finished_reason=length}`. Checks that every series carries
    vLLM's `model_name` and `engine` labels, which the key then leaves out."""
    types, samples = {}, {}
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        for sample in family.samples:
            labels = dict(sample.labels)
            assert (labels.pop("model_name"), labels.pop("engine")) == (MODEL, "0"), sample
            rest = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
            samples[f"{sample.name}{{{rest}}}" if rest else sample.name] = sample.value
    return types, samples


def scrape(url: str) -> tuple[dict[str, str], dict[str, float]]:
    response = httpx.get(f"{url}/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return parse(response.text)


def complete(url: str, prompt: list[int] = PROMPT):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=5)


def test_metrics_have_vllm_names_and_types(served):
    _, url = served
    complete(url)
    types, samples = scrape(url)
    assert {name: types.get(name) for name in VLLM_TYPES} == VLLM_TYPES
    assert "vllm:prompt_tokens_total" in samples  # the series name dashboards query
    for reason in ("stop", "length", "abort", "error"):
        assert f"vllm:request_success_total{{finished_reason={reason}}}" in samples
    assert "vllm:time_to_first_token_seconds_bucket{le=2560.0}" in samples  # vLLM's buckets
    own = {name for name in types if name.startswith("metal_serve_")}
    assert own <= {"metal_serve_requests_rejected", "metal_serve_requests_rejected_created",
                   "metal_serve_prompts_waiting", "metal_serve_kernel_fallbacks"}
    assert "vllm:external_prefix_cache_hits" not in types  # no disk tier here


def test_counters_and_histograms_move_with_requests(served):
    engine, url = served
    _, before = scrape(url)
    prompt = list(range(50, 90))  # one no other test sends
    for _ in range(2):  # the second finds the prompt's full blocks cached
        reply = complete(url, prompt)
    _, after = scrape(url)

    def moved(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert moved("vllm:request_success_total{finished_reason=length}") == 2
    assert moved("vllm:request_success_total{finished_reason=stop}") == 0
    assert moved("vllm:prompt_tokens_total") == 2 * reply.usage.prompt_tokens == 2 * len(prompt)
    assert moved("vllm:generation_tokens_total") == 2 * reply.usage.completion_tokens == 10
    assert moved("vllm:time_to_first_token_seconds_count") == 2
    assert moved("vllm:e2e_request_latency_seconds_count") == 2
    assert moved("vllm:inter_token_latency_seconds_count") == 2 * 4
    assert moved("vllm:prefix_cache_queries_total") == 2 * len(prompt)
    assert moved("vllm:prefix_cache_hits_total") == 32
    assert after["vllm:num_preemptions_total"] == engine.scheduler.num_preemptions
    assert after["vllm:num_requests_running"] == after["vllm:num_requests_waiting"] == 0
    assert after["vllm:kv_cache_usage_perc"] == 0  # finished requests' cached blocks are free


def test_gauges_show_a_running_and_a_waiting_request(model_dir):
    engine = make_engine(model_dir, max_num_seqs=1)
    for request_id in ("a", "b"):
        engine.add_request(request_id, PROMPT, SamplingParams(max_tokens=4))
    engine.step()  # "a" prefills; "b" waits for a seat
    stats = engine.stats()
    types, samples = parse(ServerMetrics(lambda: stats, MODEL).render()[0].decode())
    assert samples["vllm:num_requests_running"] == 1 and samples["vllm:num_requests_waiting"] == 1
    pool = engine.scheduler.pool
    assert samples["vllm:kv_cache_usage_perc"] == pool.num_used_blocks / pool.num_blocks
    assert 0 < samples["vllm:kv_cache_usage_perc"] < 1 and pool.num_used_blocks == 3


def serve_once(model_dir, kv_dir) -> tuple[dict[str, str], dict[str, float]]:
    """Answer one request on a server whose prefix cache spills to `kv_dir` at shutdown."""
    engine = make_engine(model_dir, kv_cache_dir=kv_dir)
    with running_app(build_app(AsyncEngine(engine), MODEL)) as url:
        complete(url)
        return scrape(url)


def test_disk_tier_hits_are_external_prefix_cache_hits(model_dir, tmp_path):
    types, first = serve_once(model_dir, tmp_path)
    assert types["vllm:external_prefix_cache_hits"] == "counter"
    assert first["vllm:external_prefix_cache_queries_total"] == len(PROMPT)
    assert first["vllm:external_prefix_cache_hits_total"] == 0
    _, again = serve_once(model_dir, tmp_path)
    assert again["vllm:prefix_cache_queries_total"] == len(PROMPT)
    assert again["vllm:prefix_cache_hits_total"] == 0  # a fresh pool
    assert again["vllm:external_prefix_cache_queries_total"] == len(PROMPT)
    assert again["vllm:external_prefix_cache_hits_total"] == 32


def test_refused_requests_are_counted_as_rejected(served):
    _, url = served
    name = "metal_serve_requests_rejected_total"
    before = scrape(url)[1].get(name, 0.0)
    body = {"prompt": [10**9], "max_tokens": 2}  # an id the vocabulary does not have
    assert httpx.post(f"{url}/v1/completions", json=body).status_code == 400
    body = {"prompt": "hi", "max_tokens": 2, "priority": 3}  # needs the priority policy
    assert httpx.post(f"{url}/v1/completions", json=body).status_code == 400
    assert scrape(url)[1][name] - before == 1  # the token-id check never reached the engine


def test_speculative_decoding_reports_vllm_counters_and_the_acceptance(model_dir, caplog):
    from scheduler.spec_decode.config import SpeculativeConfig

    speculative = SpeculativeConfig(method="ngram", num_speculative_tokens=4,
                                    prompt_lookup_min=1, prompt_lookup_max=3)
    engine = make_engine(model_dir, speculative_config=speculative)
    caplog.set_level("INFO", logger="server.async_engine")
    with running_app(build_app(AsyncEngine(engine), MODEL)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        client.completions.create(model=MODEL, prompt=[5, 9, 17] * 4, max_tokens=24,
                                  temperature=0)
        types, samples = scrape(url)
    stats = engine.scheduler.drafter.stats
    assert stats.num_accepted_tokens > 0  # a tiny random model loops: its drafts hit
    assert types["vllm:spec_decode_num_drafts"] == "counter"
    assert samples["vllm:spec_decode_num_drafts_total"] == stats.num_drafts
    assert samples["vllm:spec_decode_num_draft_tokens_total"] == stats.num_draft_tokens
    assert samples["vllm:spec_decode_num_accepted_tokens_total"] == stats.num_accepted_tokens
    per_position = [samples[f"vllm:spec_decode_num_accepted_tokens_per_pos_total{{position={i}}}"]
                    for i in range(len(stats.accepted_per_position))]
    assert sum(per_position) == stats.num_accepted_tokens
    assert per_position == sorted(per_position, reverse=True)  # j is accepted only after j - 1
    assert samples["metal_serve:spec_decode_draft_acceptance_rate"] == pytest.approx(
        stats.num_accepted_tokens / stats.num_draft_tokens)
    assert samples["metal_serve:spec_decode_mean_acceptance_length"] == pytest.approx(
        1 + stats.num_accepted_tokens / stats.num_drafts)
    by_method = "metal_serve:spec_decode_num_{}_tokens_by_method_total{{method=ngram}}"
    assert samples[by_method.format("draft")] == stats.num_draft_tokens  # all its own lookup
    assert samples[by_method.format("accepted")] == stats.num_accepted_tokens
    assert stats.measured_seconds > 0  # its decode steps were timed
    assert samples["metal_serve:spec_decode_speedup_estimate"] == pytest.approx(
        stats.undrafted_seconds / stats.measured_seconds)
    ended = [r.getMessage() for r in caplog.records if " ended (" in r.getMessage()]
    assert ended and f"{stats.num_accepted_tokens} of {stats.num_draft_tokens} draft tokens " \
        "accepted" in ended[-1]


def test_no_spec_decode_series_without_speculation(served):
    types, _ = scrape(served[1])
    assert not [name for name in types if "spec_decode" in name]


def test_the_cache_config_names_the_pools_blocks_and_kv_dtype(model_dir):
    """vLLM's info gauge: the pool's blocks at one --kv-cache-memory, more with int8 (than
    float32, the CPU backend's, 64 bytes a row of this head dim 16 against 16 + 2)."""
    blocks = {}
    for kv_cache_dtype in ("auto", "int8"):
        stats = make_engine(model_dir, kv_cache_dtype=kv_cache_dtype).stats()
        _, samples = parse(ServerMetrics(lambda stats=stats: stats, MODEL).render()[0].decode())
        (series,) = [name for name in samples if name.startswith("vllm:cache_config_info")]
        labels = dict(part.split("=") for part in series[series.index("{") + 1 : -1].split(","))
        assert labels["block_size"] == "16" and samples[series] == 1
        blocks[labels["cache_dtype"]] = int(labels["num_gpu_blocks"])
    assert blocks["int8"] == blocks["float32"] * 64 // 18
