"""A prefill server and a decode server behind vllm-router's PD mode (docs/prefill-decode.md).

Three real `metal-serve serve` processes: the prefill server (`--kv-write-through`) and the
decode server share a `--kv-cache-dir`; a third, without any prefix cache, is the one server
alone that the pair must match. Through the router, a greedy chat completion, streamed or not,
gives exactly that server's text; the prefill server ran the request for one output token, and
the decode server found every full block of the prompt cached, those of the prompt's own text
loaded from the shared directory.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from server.bench.server_process import free_port, stop, wait_ready

pytest.importorskip("vllm_router", reason="vllm-router (the dev extra) is not installed")
pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
BLOCK_SIZE = 16  # `metal-serve serve`'s default --block-size
SMALL = ["--max-model-len", "2048", "--kv-cache-memory", "128MiB"]
MAX_TOKENS = 24
# All MAX_TOKENS of them, so that the texts compared are long enough to tell apart.
GREEDY = dict(max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
ENDED = re.compile(r"\[(?P<log_id>[^\]]+)\] (?P<id>\S+) ended \(\w+\): (?P<prompt>\d+) prompt "
                   r"tokens \((?P<cached>\d+) cached\), (?P<generated>\d+) generated")


@dataclass(frozen=True)
class Process:
    process: subprocess.Popen
    url: str
    log: Path

    def ended(self, key: str, value: str) -> re.Match:
        """The log's line for the request whose `key` (`id` or `log_id`) is `value`."""
        matches = [m for m in ENDED.finditer(self.log.read_text()) if m[key] == value]
        assert len(matches) == 1, f"{self.log} has {len(matches)} lines for {key}={value}"
        return matches[0]


@dataclass(frozen=True)
class Cluster:
    prefill: Process
    decode: Process
    alone: Process
    router_url: str


def start(command: list[str], log_path: Path, port: int) -> Process:
    # One BLAS thread each: three processes' thread pools fighting over a few cores ran slower.
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    with log_path.open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                   start_new_session=True)  # fmt: skip
    return Process(process, f"http://127.0.0.1:{port}", log_path)


def serve(model_dir: Path, logs: Path, name: str, *flags: str) -> Process:
    port = free_port()
    command = [str(BIN / "metal-serve"), "serve", str(model_dir), "--port", str(port), *SMALL,
               *flags]  # fmt: skip
    return start(command, logs / f"{name}.log", port)


def pd_router(prefill_url: str, decode_url: str, logs: Path) -> Process:
    port = free_port()
    command = [str(BIN / "vllm-router"), "--host", "127.0.0.1", "--port", str(port),
               "--vllm-pd-disaggregation", "--prefill", prefill_url, "--decode", decode_url,
               "--policy", "round_robin", "--worker-startup-check-interval", "1",
               "--prometheus-port", str(free_port()), "--log-level", "warning"]  # fmt: skip
    return start(command, logs / "router.log", port)


@pytest.fixture(scope="module")
def cluster(default_model_dir, tmp_path_factory) -> Iterator[Cluster]:
    """The three servers, started together so that they load the model at the same time, and
    the router once they answer."""
    logs = tmp_path_factory.mktemp("prefill-decode")
    shared = ["--kv-cache-dir", str(logs / "kv")]
    started: list[Process] = []
    try:
        started += [serve(default_model_dir, logs, "prefill", *shared, "--kv-write-through"),
                    serve(default_model_dir, logs, "decode", *shared),
                    serve(default_model_dir, logs, "alone", "--no-prefix-caching")]  # fmt: skip
        for server in started:
            wait_ready(server.process, server.url, server.log, timeout_s=180)
        prefill, decode, alone = started
        started.append(pd_router(prefill.url, decode.url, logs))
        wait_ready(started[-1].process, started[-1].url, started[-1].log, timeout_s=60)
        yield Cluster(prefill, decode, alone, started[-1].url)
    finally:
        for process in started:
            stop(process.process)


def client(url: str) -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key="local", max_retries=0, timeout=60.0)


def messages(topic: str) -> list[dict]:
    """A prompt of several blocks; a topic per test, so that no server has its text cached."""
    return [{"role": "user", "content":
             f"Here is a question about {topic}. Explain in plain words, for someone who has "
             f"never studied it, what {topic} is, why people care about it, and give one "
             "everyday example. Keep the answer short and start with a one-line summary."}]


def alone_text(cluster: Cluster, topic: str) -> str:
    answer = client(cluster.alone.url).chat.completions.create(
        model="default", messages=messages(topic), **GREEDY)
    return answer.choices[0].message.content


def cache_hits(server: Process) -> tuple[float, float]:
    """Prompt tokens the server has found so far in its memory and in its disk tier."""
    text = httpx.get(f"{server.url}/metrics", timeout=10.0).text
    totals = {family.name: sum(s.value for s in family.samples if s.name.endswith("_total"))
              for family in text_string_to_metric_families(text)}  # fmt: skip
    return totals["vllm:prefix_cache_hits"], totals["vllm:external_prefix_cache_hits"]


def assert_handed_over(
    cluster: Cluster, response_id: str, hits_before: tuple[float, float]
) -> None:
    """The decode server's request found the prompt's full blocks cached: in memory those an
    earlier prompt shared (the chat template's system prompt), from disk the rest, which the
    prefill server computed when it ran the same request (the router's X-Request-Id) for one
    token."""
    decoded = cluster.decode.ended("id", response_id)
    prompt, cached = int(decoded["prompt"]), int(decoded["cached"])
    # Every full block but one that would hold the prompt's last token (it must be computed).
    assert cached == (prompt - 1) // BLOCK_SIZE * BLOCK_SIZE > 0
    (memory, disk), (memory_before, disk_before) = cache_hits(cluster.decode), hits_before
    assert (memory - memory_before) + (disk - disk_before) == cached and disk > disk_before
    prefilled = cluster.prefill.ended("log_id", decoded["log_id"])
    assert (int(prefilled["prompt"]), int(prefilled["generated"])) == (prompt, 1)


def test_greedy_chat_through_the_pair_matches_one_server(cluster):
    hits_before = cache_hits(cluster.decode)
    answer = client(cluster.router_url).chat.completions.create(
        model="default", messages=messages("entropy"), **GREEDY)
    assert answer.choices[0].message.content == alone_text(cluster, "entropy")
    assert answer.usage.completion_tokens == MAX_TOKENS
    assert_handed_over(cluster, answer.id, hits_before)


def test_streamed_chat_through_the_pair_matches_one_server(cluster):
    hits_before = cache_hits(cluster.decode)
    stream = client(cluster.router_url).chat.completions.create(
        model="default", messages=messages("inflation"), **GREEDY, stream=True)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == alone_text(cluster, "inflation")
    assert_handed_over(cluster, chunks[0].id, hits_before)


def test_a_bad_request_gets_the_servers_own_error(cluster):
    """The prefill server's 400 comes back as it is; the decode server never sees it."""
    posts = cluster.decode.log.read_text().count("POST /v1/chat/completions")
    response = httpx.post(f"{cluster.router_url}/v1/chat/completions", timeout=30.0, json={
        "model": "default", "messages": messages("gravity"), "temperature": -1})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "temperature"
    assert cluster.decode.log.read_text().count("POST /v1/chat/completions") == posts
