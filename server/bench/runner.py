"""Drive a workload against a server: pacing, concurrency, agent turns, then token counts."""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from server.bench.client import CHAT, Sampling, StreamResult, stream_request
from server.bench.encoder_metrics import EncoderCounts, encoder_counts
from server.bench.metrics import Metrics, RequestRecord, compute_metrics
from server.bench.workloads import AgentSession, RequestSpec

Sender = Callable[[RequestSpec], Awaitable[StreamResult]]
WARMUP_OUTPUT_LEN = 16
WARMUP_PROMPT = "Count from one to twenty."


@dataclass(frozen=True)
class Target:
    """Where and how to send: one server, one endpoint, one set of sampling fields."""

    base_url: str
    endpoint: str
    sampling: Sampling
    timeout_s: float = 600.0
    num_warmups: int = 1


@dataclass(frozen=True)
class Sent:
    spec: RequestSpec
    start: float  # from the run's start
    result: StreamResult
    session: int | None = None
    turn: int | None = None


@dataclass(frozen=True)
class RunResult:
    max_concurrency: int | None
    request_rate: float
    metrics: Metrics
    records: tuple[RequestRecord, ...]
    encoder: EncoderCounts | None = None  # the vision encoder's work in the run, if measured

    def to_json(self) -> dict:
        return {
            "max_concurrency": self.max_concurrency,
            "request_rate": None if math.isinf(self.request_rate) else self.request_rate,
            "metrics": self.metrics.to_json(),
            "encoder": self.encoder.to_json() if self.encoder is not None else None,
            "records": [r.to_json() for r in self.records],
        }


async def send_requests(
    specs: Sequence[RequestSpec],
    send: Sender,
    max_concurrency: int | None = None,
    request_rate: float = math.inf,
    rng: random.Random | None = None,
) -> list[Sent]:
    """Start requests at Poisson arrivals (`request_rate` per second; inf = all at once),
    with at most `max_concurrency` in flight. Results in workload order."""
    rng = rng or random.Random(0)
    limit = asyncio.Semaphore(max_concurrency or len(specs) or 1)
    t0 = time.perf_counter()

    async def one(spec: RequestSpec) -> Sent:
        async with limit:
            start = time.perf_counter() - t0
            return Sent(spec, start, await send(spec))

    tasks = []
    for spec in specs:
        tasks.append(asyncio.create_task(one(spec)))
        if not math.isinf(request_rate):
            await asyncio.sleep(rng.expovariate(request_rate))
    return list(await asyncio.gather(*tasks))


async def run_sessions(
    sessions: Sequence[AgentSession], send: Sender, max_concurrency: int | None = None
) -> list[Sent]:
    """Each session sends its turns in order, each turn the whole conversation so far;
    up to `max_concurrency` sessions run at once. A failed turn ends its session."""
    limit = asyncio.Semaphore(max_concurrency or len(sessions) or 1)
    t0 = time.perf_counter()

    async def one(index: int, session: AgentSession) -> list[Sent]:
        sent = []
        messages = [
            {"role": "system", "content": session.system},
            {"role": "user", "content": session.task},
        ]
        async with limit:
            for turn in range(len(session.tool_results) + 1):
                spec = RequestSpec(tuple(messages), session.output_len)
                start = time.perf_counter() - t0
                result = await send(spec)
                sent.append(Sent(spec, start, result, session=index, turn=turn))
                if result.error is not None or turn == len(session.tool_results):
                    break
                messages.append({"role": "assistant", "content": result.text})
                messages.append({"role": "user", "content": session.tool_results[turn]})
        return sent

    per_session = await asyncio.gather(*(one(i, s) for i, s in enumerate(sessions)))
    return [sent for session in per_session for sent in session]


class TokenCounter:
    """Counts tokens with one tokenizer, so every server is measured the same way."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def text(self, text: str) -> int:
        return len(self._tokenizer.encode(text, add_special_tokens=False)) if text else 0

    def prompt(self, spec: RequestSpec, endpoint: str) -> int:
        if endpoint != CHAT or not getattr(self._tokenizer, "chat_template", None):
            return self.text(spec.prompt())
        encoded = self._tokenizer.apply_chat_template(
            list(spec.messages), add_generation_prompt=True, tokenize=True, return_dict=True
        )
        return len(encoded["input_ids"])

    def record(self, sent: Sent, endpoint: str) -> RequestRecord:
        result = sent.result
        return RequestRecord(
            start=sent.start,
            latency=result.latency,
            chunk_times=result.chunk_times,
            input_tokens=self.prompt(sent.spec, endpoint),
            output_tokens=self.text(result.text),
            server_output_tokens=result.server_output_tokens,
            server_input_tokens=result.server_input_tokens,
            output_text=result.text,
            error=result.error,
            session=sent.session,
            turn=sent.turn,
        )


async def run_workload(
    target: Target,
    counter: TokenCounter,
    *,
    requests: Sequence[RequestSpec] = (),
    sessions: Sequence[AgentSession] = (),
    max_concurrency: int | None = None,
    request_rate: float = math.inf,
    slos_ms: dict[str, float] | None = None,
    seed: int = 0,
    warmup: RequestSpec | None = None,
    measure_encoder: bool = False,
) -> RunResult:
    """Warm up (with `warmup`, else a short prompt of its own), then run the independent
    `requests` or the agent `sessions` once. `measure_encoder`: read the server's vision
    encoder counters before and after the timed run."""
    timeout = httpx.Timeout(target.timeout_s, connect=30.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=target.base_url, timeout=timeout, limits=limits) as http:

        async def send(spec: RequestSpec) -> StreamResult:
            return await stream_request(http, target.endpoint, spec, target.sampling)

        await _warm_up(send, target.num_warmups, warmup)
        before = await encoder_counts(http) if measure_encoder else None
        t0 = time.perf_counter()
        if sessions:
            sent = await run_sessions(sessions, send, max_concurrency)
        else:
            rng = random.Random(seed)
            sent = await send_requests(requests, send, max_concurrency, request_rate, rng)
        duration = time.perf_counter() - t0
        after = await encoder_counts(http) if before is not None else None
    records = tuple(counter.record(s, target.endpoint) for s in sent)
    metrics = compute_metrics(records, duration, slos_ms)
    encoder = after - before if after is not None and before is not None else None
    return RunResult(max_concurrency, request_rate, metrics, records, encoder)


async def _warm_up(send: Sender, count: int, spec: RequestSpec | None) -> None:
    """Untimed requests first, so one-time startup costs stay out of the numbers."""
    # A prompt of its own: reusing a workload prompt would warm the server's prefix cache.
    spec = spec or RequestSpec(({"role": "user", "content": WARMUP_PROMPT},), WARMUP_OUTPUT_LEN)
    for _ in range(count):
        result = await send(spec)
        if result.error is not None:
            raise RuntimeError(f"the warm-up request failed: {result.error}")
