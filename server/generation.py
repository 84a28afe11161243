"""Run one request through the AsyncEngine: start it, collect it, or stream it as SSE."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from pydantic import BaseModel
from starlette.requests import Request

from scheduler.request import FinishReason
from server.async_engine import AsyncEngine, EngineError
from server.errors import APIError
from server.protocol import Usage

if TYPE_CHECKING:
    from metal_engine.outputs import RequestOutput
    from scheduler import SamplingParams

T = TypeVar("T")
Outputs = AsyncGenerator["RequestOutput", None]


@dataclass(frozen=True)
class Result:
    text: str
    finish_reason: FinishReason | None
    usage: Usage


def usage_of(output: RequestOutput) -> Usage:
    return Usage.of(output.num_prompt_tokens, output.num_output_tokens, output.num_cached_tokens)


async def start(
    engine: AsyncEngine, prompt_ids: list[int], params: SamplingParams, request_id: str
) -> Outputs:
    """Submit the request and wait for its first output, so that a refusal is still a 400."""
    outputs = engine.generate(prompt_ids, params, request_id)
    try:
        first = await anext(outputs)
    except ValueError as exc:
        raise APIError(str(exc)) from exc
    except EngineError as exc:
        raise APIError(str(exc), status_code=500) from exc
    return _prepend(first, outputs)


async def _prepend(first: RequestOutput, rest: Outputs) -> Outputs:
    # Closing this closes `rest` at once, which aborts the request if it is still running.
    async with contextlib.aclosing(rest):
        yield first
        if not first.finished:
            async for output in rest:
                yield output


async def collect(outputs: Outputs) -> Result:
    """The whole completion, for non-streaming responses."""
    pieces: list[str] = []
    last: RequestOutput | None = None
    try:
        async with contextlib.aclosing(outputs):
            async for output in outputs:
                pieces.append(output.new_text)
                last = output
    except EngineError as exc:
        raise APIError(str(exc), status_code=500) from exc
    assert last is not None, "start() always yields a first output"
    return Result("".join(pieces), last.finish_reason, usage_of(last))


def sse(payload: BaseModel | dict) -> str:
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"


async def sse_stream(
    outputs: Outputs,
    chunk: Callable[[str, FinishReason | None], BaseModel],
    usage_chunk: Callable[[Usage], BaseModel] | None = None,
    head: BaseModel | None = None,
) -> AsyncIterator[str]:
    """SSE events: `head`, one chunk per non-empty delta (the last carries the finish
    reason), then the usage chunk if asked for, then `[DONE]`. An engine failure after the
    headers went out becomes an error event, which the OpenAI clients raise."""
    try:
        async with contextlib.aclosing(outputs):
            if head is not None:
                yield sse(head)
            last: RequestOutput | None = None
            async for output in outputs:
                last = output
                if output.new_text or output.finished:
                    yield sse(chunk(output.new_text, output.finish_reason))
        if usage_chunk is not None and last is not None:
            yield sse(usage_chunk(usage_of(last)))
    except EngineError as exc:
        yield sse(APIError(str(exc), status_code=500).body())
    yield "data: [DONE]\n\n"


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Await `work`, but cancel it (aborting its request) if the client goes away first.

    Returns None on disconnect. Streaming responses need no such guard: Starlette cancels
    the body iterator itself when the client disconnects.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None


async def _disconnected(request: Request) -> None:
    # The body was read already, so the next message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
