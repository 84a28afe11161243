"""Two real `metal-serve serve` replicas behind a real vllm-router (docs/router.md).

An agents run (sessions resending a growing conversation) through the router's `cache_aware`
policy keeps each session on the replica holding its prefix (each turn's `cached_tokens` cover
its previous prompt), and the replicas' own prefix-cache hit rate beats `round_robin` on the
same workload. Killing one replica mid-run sends the remaining turns to the other, and every
request ends well within its timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import httpx
import pytest

from server.bench import router
from server.bench.server_process import free_port, stop, wait_ready
from server.bench.workloads import AgentSession, TokenText, agent_sessions

pytest.importorskip("vllm_router", reason="vllm-router (the dev extra) is not installed")
pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
REQUEST_TIMEOUT_S = 60.0
# Sessions with their own large context after a small shared system prompt, as agents working
# on different tasks: a new session matches no replica well, its later turns match one.
SESSIONS, TURNS = 5, 3
SYSTEM_LEN, TASK_LEN, TOOL_RESULT_LEN, OUTPUT_LEN = 32, 128, 32, 8
# A new session's first prompt matches a replica by its shared system prompt only (~40%); a
# later turn matches the replica holding the session's previous turn (~85%). A threshold
# between the two spreads new sessions by load and keeps each one where it started.
POLICIES = {
    "round_robin": ["--policy", "round_robin"],
    "cache_aware": ["--policy", "cache_aware", "--cache-threshold", "0.6"],
}
# Fail fast onto the other replica: a dead one leaves the pool at its first refused request.
FAILOVER = ["--cb-failure-threshold", "1", "--health-check-interval-secs", "1",
            "--health-failure-threshold", "1"]  # fmt: skip


@dataclass(frozen=True)
class Replica:
    process: subprocess.Popen
    url: str
    log: Path


@pytest.fixture(scope="module")
def replicas(default_model_dir, tmp_path_factory) -> Iterator[list[Replica]]:
    """Two replicas, started together so that they load the model at the same time."""
    logs = tmp_path_factory.mktemp("replicas")
    # One BLAS thread each: two replicas' thread pools fighting over a few cores ran 3x slower.
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    started: list[Replica] = []
    try:
        for index in range(2):
            port, log_path = free_port(), logs / f"replica{index}.log"
            command = [str(BIN / "metal-serve"), "serve", str(default_model_dir),
                       "--port", str(port), "--max-model-len", "2048",
                       "--kv-cache-memory", "256MiB", "--max-num-seqs", "8"]  # fmt: skip
            with log_path.open("w") as log:
                process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                           env=env, start_new_session=True)  # fmt: skip
            started.append(Replica(process, f"http://127.0.0.1:{port}", log_path))
        for replica in started:
            wait_ready(replica.process, replica.url, replica.log, timeout_s=180)
        yield started
    finally:
        for replica in started:
            stop(replica.process)


@contextlib.contextmanager
def running_router(urls: list[str], policy: str, log_path: Path) -> Iterator[str]:
    """vllm-router over `urls` with one of `POLICIES`; yields its base URL."""
    port = free_port()
    command = [str(BIN / "vllm-router"), "--host", "127.0.0.1", "--port", str(port),
               "--worker-urls", *urls, *POLICIES[policy],
               "--worker-startup-check-interval", "1", "--prometheus-port", str(free_port()),
               "--log-level", "warning", *FAILOVER]  # fmt: skip
    with log_path.open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(process, url, log_path, timeout_s=60)
        yield url
    finally:
        stop(process)


def sessions(default_tokenizer, seed: int) -> list[AgentSession]:
    """A fresh workload per seed, so that no run finds another's prompts cached."""
    rng = random.Random(seed)
    text = TokenText(default_tokenizer, rng)
    return agent_sessions(text, rng, SESSIONS, TURNS, SYSTEM_LEN, TASK_LEN, TOOL_RESULT_LEN,
                          OUTPUT_LEN)  # fmt: skip


class Turn(NamedTuple):
    session: int
    turn: int
    start: float  # time.monotonic()
    seconds: float
    status: int
    prompt_tokens: int = 0
    cached_tokens: int = 0


def chat_body(messages: list[dict]) -> dict:
    return {"model": "default", "messages": messages, "max_tokens": OUTPUT_LEN,
            "temperature": 0, "ignore_eos": True}  # fmt: skip


async def run_turns(
    url: str, agents: list[AgentSession], after_turn: Callable[[int], None] = lambda _: None
) -> list[Turn]:
    """The sessions at once, each sending its turns in order, the whole conversation each time
    (not streamed, so the router may retry a turn whose replica died). `after_turn(n)` runs
    when n turns in all have answered. A failed turn ends its session."""
    turns: list[Turn] = []

    async def session(client: httpx.AsyncClient, index: int, agent: AgentSession) -> None:
        messages = [{"role": "system", "content": agent.system},
                    {"role": "user", "content": agent.task}]  # fmt: skip
        for turn in range(TURNS):
            start = time.monotonic()
            response = await client.post("/v1/chat/completions", json=chat_body(messages))
            seconds = time.monotonic() - start
            if response.status_code != 200:
                turns.append(Turn(index, turn, start, seconds, response.status_code))
                return
            body = response.json()
            usage = body["usage"]
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            turns.append(Turn(index, turn, start, seconds, 200, usage["prompt_tokens"], cached))
            after_turn(sum(t.status == 200 for t in turns))
            if turn + 1 < TURNS:
                answer = body["choices"][0]["message"]["content"]
                messages += [{"role": "assistant", "content": answer},
                             {"role": "user", "content": agent.tool_results[turn]}]  # fmt: skip

    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT_S) as client:
        runs = (session(client, i, agent) for i, agent in enumerate(agents))
        await asyncio.wait_for(asyncio.gather(*runs), timeout=4 * REQUEST_TIMEOUT_S)
    return turns


def on_their_prefix(turns: list[Turn]) -> float:
    """The share of later turns that found (nearly) all of the session's previous prompt in
    the cache of the replica they reached: they went where the session had been."""
    prompts = {(t.session, t.turn): t.prompt_tokens for t in turns}
    later = [t for t in turns if t.turn > 0]
    found = [t for t in later if t.cached_tokens >= 0.9 * prompts[t.session, t.turn - 1]]
    return len(found) / len(later)


def policy_run(replicas, policy: str, agents, tmp_path) -> tuple[list[router.PrefixCounts], float]:
    """Each replica's prefix-cache counts during the run, and `on_their_prefix`."""
    urls = [r.url for r in replicas]
    before = router.snapshot(urls)
    with running_router(urls, policy, tmp_path / f"{policy}.log") as url:
        turns = asyncio.run(run_turns(url, agents))
    assert [t.status for t in turns] == [200] * SESSIONS * TURNS
    return router.since(urls, before), on_their_prefix(turns)


def test_cache_aware_keeps_sessions_on_their_prefix(
    replicas, default_tokenizer, tmp_path, capsys
):
    urls = [r.url for r in replicas]
    runs = {policy: policy_run(replicas, policy, sessions(default_tokenizer, seed), tmp_path)
            for seed, policy in enumerate(("round_robin", "cache_aware"))}  # fmt: skip
    with capsys.disabled():  # the numbers belong in the test's output, pass or fail
        for policy, (counts, sticky) in runs.items():
            print(f"\n{policy}, {SESSIONS} sessions x {TURNS} turns: {sticky:.0%} of later "
                  "turns reached the replica holding their session")  # fmt: skip
            print(router.format_replica_hits(urls, counts))
    (rr_counts, rr_sticky), (ca_counts, ca_sticky) = runs["round_robin"], runs["cache_aware"]
    assert router.overall(ca_counts).rate > router.overall(rr_counts).rate
    assert ca_sticky >= 0.8 and ca_sticky > rr_sticky
    # Sessions were spread over both replicas, not all piled onto one.
    assert all(c.queried > 0 for c in ca_counts)


def test_killed_replica_fails_over(replicas, default_tokenizer, tmp_path, capsys):
    # Last in the module: it leaves the first replica dead.
    urls = [r.url for r in replicas]
    victim, before = replicas[0], router.prefix_counts(replicas[0].url)
    served, killed_at = [], []

    def kill_after_a_third(done: int) -> None:
        if done == SESSIONS * TURNS // 3 and not killed_at:
            served.append(router.prefix_counts(victim.url) - before)
            victim.process.kill()
            killed_at.append(time.monotonic())

    with running_router(urls, "cache_aware", tmp_path / "router.log") as url:
        turns = asyncio.run(run_turns(url, sessions(default_tokenizer, 3), kill_after_a_third))
        assert killed_at, "the run ended before the kill"
        after = [t for t in turns if t.start > killed_at[0]]
        with capsys.disabled():
            print(f"\nkill: {len(turns)} turns, {len(after)} sent after the kill, slowest "
                  f"{max(t.seconds for t in turns):.1f} s")  # fmt: skip
        assert served[0].queried > 0  # sessions lived on the killed replica
        assert [t.status for t in turns] == [200] * SESSIONS * TURNS  # no session lost a turn
        assert after
        # The survivor answers the router's own health check and the models list.
        assert httpx.get(f"{url}/v1/models", timeout=10).status_code == 200
    victim.process.wait(10)
    assert httpx.get(f"{urls[1]}/health", timeout=10).status_code == 200
