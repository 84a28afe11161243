"""A tiny-model server for the dashboard tests, a request that keeps streaming, and the
numbers of /metrics and /dashboard/state."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import running_app
from tiny_server import tiny_engine

from server.app import HttpOptions, build_app
from server.async_engine import AsyncEngine

# ~3 ms a token on a CPU: a stream of this many lasts seconds, longer than any check on it.
LONG_STREAM_TOKENS = 3000
MAX_MODEL_LEN = 4096
# Token ids: the tiny model's word-level tokenizer reads any text as one unknown word.
PROMPT = list(range(3, 43))  # two full blocks of 16 and a bit

# The tests' own HTTP clients log each request at INFO; none of that is what they check, and
# a handler another test left on the root logger may write to a stream already closed.
logging.getLogger("httpx").setLevel(logging.WARNING)


@contextlib.contextmanager
def tiny_dashboard_server(path: Path, api_keys: tuple[str, ...] = (),
                          log_prompts: bool = False) -> Iterator[str]:
    """A real server over the tiny random Llama (no end-of-sequence token); its base URL."""
    engine = tiny_engine(path, max_model_len=MAX_MODEL_LEN)
    app = build_app(AsyncEngine(engine, log_prompts=log_prompts), "tiny",
                    options=HttpOptions(api_keys=api_keys))
    with running_app(app) as url:
        yield url


@contextlib.contextmanager
def streaming_completion(url: str, prompt: list[int] = PROMPT, api_key: str = "x") -> Iterator[str]:
    """A completion streaming (its first chunk read) until the block exits, which closes it
    (the server aborts it); yields its id."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0)
    stream = client.completions.create(model="tiny", prompt=prompt,
                                       max_tokens=LONG_STREAM_TOKENS, stream=True)
    try:
        yield next(iter(stream)).id
    finally:
        stream.close()


def complete(url: str, prompt: list[int] = PROMPT, max_tokens: int = 8,
             api_key: str = "x") -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0)
    client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens)


def state(url: str, api_key: str | None = None) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.get(f"{url}/dashboard/state", headers=headers)
    response.raise_for_status()
    return response.json()


def scrape(url: str) -> dict[str, float]:
    """/metrics' samples by name, plus their labels past model_name and engine, e.g.
    `vllm:request_success_total{finished_reason=stop}`."""
    samples = {}
    text = httpx.get(f"{url}/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = {k: v for k, v in sample.labels.items() if k not in ("model_name", "engine")}
            rest = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
            samples[f"{sample.name}{{{rest}}}" if rest else sample.name] = sample.value
    return samples


def metrics_view(samples: dict[str, float]) -> dict[str, float]:
    """The dashboard's numbers, as /metrics names them."""
    view = {
        "requests.running": samples["vllm:num_requests_running"],
        "requests.waiting": samples["vllm:num_requests_waiting"],
        "kv_cache.usage": samples["vllm:kv_cache_usage_perc"],
        "prefix_cache.queried_tokens": samples["vllm:prefix_cache_queries_total"],
        "prefix_cache.hit_tokens": samples["vllm:prefix_cache_hits_total"],
        "totals.preemptions": samples["vllm:num_preemptions_total"],
        "totals.prompt_tokens": samples["vllm:prompt_tokens_total"],
        "totals.generation_tokens": samples["vllm:generation_tokens_total"],
        "totals.requests_rejected": samples["metal_serve_requests_rejected_total"],
    }
    for reason in ("stop", "length", "abort", "error"):
        view[f"totals.requests_finished.{reason}"] = samples[
            f"vllm:request_success_total{{finished_reason={reason}}}"
        ]
    return view


def lookup(document: dict, path: str):
    for key in path.split("."):
        document = document[key]
    return document


def wait_for(condition: Callable[[], object], timeout_s: float = 10.0):
    """`condition()`'s first truthy value, polled until `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)
    return value
