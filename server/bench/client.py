"""One streaming request to an OpenAI-compatible server, timed chunk by chunk."""

from __future__ import annotations

import time
from dataclasses import dataclass

import httpx

from server.bench.sse import SSEDecoder, parse_event
from server.bench.workloads import RequestSpec

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
ENDPOINTS = (CHAT, COMPLETIONS)


@dataclass(frozen=True)
class Sampling:
    """What every request asks for besides its prompt."""

    model: str | None
    temperature: float = 0.0
    ignore_eos: bool = True
    eos_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class StreamResult:
    """Times in seconds from the request's start."""

    chunk_times: tuple[float, ...]
    latency: float
    text: str
    server_output_tokens: int | None
    error: str | None
    server_input_tokens: int | None = None


def request_body(endpoint: str, spec: RequestSpec, sampling: Sampling) -> dict:
    body: dict = {
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": spec.output_len,
        "temperature": sampling.temperature,
    }
    model = spec.model or sampling.model
    if model is not None:
        body["model"] = model
    if endpoint == CHAT:
        body["messages"] = [dict(m) for m in spec.messages]
    else:
        body["prompt"] = spec.prompt()
    if sampling.ignore_eos:
        # `ignore_eos` is the vLLM extension (ours and llama.cpp's server read it); servers
        # without it still honour the standard `logit_bias`, which bans the end tokens.
        body["ignore_eos"] = True
        body["logit_bias"] = {str(i): -100 for i in sampling.eos_token_ids}
    return body


async def stream_request(
    client: httpx.AsyncClient, endpoint: str, spec: RequestSpec, sampling: Sampling
) -> StreamResult:
    """Send one request and read its stream; failures come back as `error`, never raised."""
    stream = _Stream(time.perf_counter())
    try:
        body = request_body(endpoint, spec, sampling)
        async with client.stream("POST", endpoint, json=body) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:300]
                stream.error = f"HTTP {response.status_code} from {endpoint}: {detail}"
            else:
                decoder = SSEDecoder()
                async for piece in response.aiter_text():
                    stream.take(decoder.feed(piece))
                stream.take(decoder.close())
    except httpx.HTTPError as exc:
        stream.error = f"{type(exc).__name__} talking to {client.base_url}{endpoint}: {exc}"
    return stream.result()


class _Stream:
    """What has arrived so far on one response."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.chunk_times: list[float] = []
        self.texts: list[str] = []
        self.server_tokens: int | None = None
        self.server_prompt_tokens: int | None = None
        self.error: str | None = None

    def take(self, events: list[str]) -> None:
        now = time.perf_counter() - self.start
        for data in events:
            delta = parse_event(data)
            if delta.text:
                self.chunk_times.append(now)
                self.texts.append(delta.text)
            self.server_tokens = delta.completion_tokens or self.server_tokens
            self.server_prompt_tokens = delta.prompt_tokens or self.server_prompt_tokens
            self.error = self.error or delta.error

    def result(self) -> StreamResult:
        return StreamResult(
            chunk_times=tuple(self.chunk_times),
            latency=time.perf_counter() - self.start,
            text="".join(self.texts),
            server_output_tokens=self.server_tokens,
            error=self.error,
            server_input_tokens=self.server_prompt_tokens,
        )
