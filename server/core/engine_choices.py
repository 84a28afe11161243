"""Run a request's choices through the AsyncEngine: start them, collect them, or stream them.

A request has one or more prompts and `n` choices per prompt; choice `p * n + i` is choice
`i` of prompt `p` (the completions API's numbering).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, TypeVar

from pydantic import BaseModel
from starlette.requests import Request

from server.async_engine import AsyncEngine, EngineError
from server.core.chat_request import Usage
from server.http.auth import prefix_cache_salt
from server.http.errors import APIError
from server.http.sse import DONE, sse

if TYPE_CHECKING:
    from metal_engine.outputs import RequestOutput
    from scheduler import SamplingParams
    from scheduler.media import PromptMedia

T = TypeVar("T")
Outputs = AsyncGenerator["RequestOutput", None]
# Every choice's outputs in the order they arrive, each with its choice index.
Choices = AsyncGenerator[tuple[int, "RequestOutput"], None]


def usage_of(lasts: list[RequestOutput], n: int = 1) -> Usage:
    """Usage over the last output of each choice, in choice order. The `n` choices of a
    prompt share it, so it counts once (with the cache hit of the choice that found least
    cached); the outputs of all choices add up."""
    per_prompt = [lasts[p : p + n] for p in range(0, len(lasts), n)]
    return Usage.of(
        sum(choices[0].num_prompt_tokens for choices in per_prompt),
        sum(o.num_output_tokens for o in lasts),
        sum(min(o.num_cached_tokens for o in choices) for choices in per_prompt),
    )


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice `index` of a prompt samples with seed `seed + index` (as vLLM does): seeded
    choices differ from each other, and a rerun with the same seed reproduces each of them."""
    if params.seed is None or index == 0:
        return params
    return dataclasses.replace(params, seed=params.seed + index)


def choice_request_ids(request_id: str, count: int) -> list[str]:
    # A single choice keeps the response id, so logs and aborts name what the client saw.
    return [request_id] if count == 1 else [f"{request_id}-{i}" for i in range(count)]


async def start(
    engine: AsyncEngine,
    prompt_ids: list[int],
    params: SamplingParams,
    request_id: str,
    n: int = 1,
    priority: int = 0,
    cache_salt: str | None = None,
    media: PromptMedia | None = None,
    lora_name: str | None = None,
) -> Choices:
    """`start_prompts` for a single prompt (with its images, `media`)."""
    return await start_prompts(engine, [prompt_ids], params, request_id, n, priority, cache_salt,
                               media, lora_name)


async def start_prompts(
    engine: AsyncEngine,
    prompts: list[list[int]],
    params: SamplingParams,
    request_id: str,
    n: int = 1,
    priority: int = 0,
    cache_salt: str | None = None,
    media: PromptMedia | None = None,
    lora_name: str | None = None,
) -> Choices:
    """Submit `n` choices of each prompt together (`media`: the images of a chat's one
    prompt; `lora_name`: the adapter that serves them, None for the base) and wait for
    each one's first output, so that a refusal is still a 400.
    Submitted together, the choices of a prompt compute its full blocks once and share them
    through the prefix cache, which they share with no request of another API key (tenant)
    or another `cache_salt`."""
    ids = choice_request_ids(request_id, len(prompts) * n)
    salt = prefix_cache_salt(cache_salt)
    streams = [
        engine.generate(prompts[k // n], choice_params(params, k % n), choice_id, priority, salt,
                        media, lora_name=lora_name)
        for k, choice_id in enumerate(ids)
    ]
    firsts = [asyncio.ensure_future(anext(s)) for s in streams]
    try:
        await asyncio.gather(*firsts)
    except BaseException as exc:
        await _close(firsts, streams)  # a refusal or a disconnect ends every choice
        if isinstance(exc, ValueError):
            raise APIError(str(exc)) from exc
        if isinstance(exc, EngineError):
            raise engine_failure(exc) from exc
        raise
    return _merge([
        _prepend(first.result(), s) for first, s in zip(firsts, streams, strict=True)
    ])


async def _close(pending: Iterable[asyncio.Future], streams: list[Outputs]) -> None:
    """Stop waiting on `pending` outputs, then close every stream (which aborts its request
    if it is still running). A stream cannot be closed while a wait on it is running."""
    pending = list(pending)
    for future in pending:
        future.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    for stream in streams:
        await stream.aclose()


async def _prepend(first: RequestOutput, rest: Outputs) -> Outputs:
    # Closing this closes `rest` at once, which aborts the request if it is still running.
    async with contextlib.aclosing(rest):
        yield first
        if not first.finished:
            async for output in rest:
                yield output


async def _merge(streams: list[Outputs]) -> Choices:
    """Interleave the choices' outputs as they arrive. Closing this closes every stream,
    which aborts the choices still running."""
    nexts = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)}
    try:
        while nexts:
            done, _ = await asyncio.wait(nexts, return_when=asyncio.FIRST_COMPLETED)
            for future in sorted(done, key=nexts.__getitem__):
                index = nexts.pop(future)
                try:
                    output = future.result()
                except StopAsyncIteration:
                    continue
                nexts[asyncio.ensure_future(anext(streams[index]))] = index
                yield index, output
    finally:
        await _close(nexts, streams)


def engine_failure(exc: EngineError) -> APIError:
    """The 500 for a request the engine failed: the error's public text only, since its
    cause's text may quote the prompt (the server log has it)."""
    return APIError(exc.public, status_code=500)


def request_failure(error: str | None = None) -> APIError:
    """The 400 for a request that failed on its own (finish_reason "error"): its grammar
    broke while generating, which the schema it came from decides. `error` says how."""
    how = f" ({error})" if error else ""
    return APIError(
        "The output could not keep to the JSON schema of response_format (or of a forced tool "
        f"call's parameters) while generating{how}. Simplify the schema, e.g. smaller "
        "repetition counts in a pattern or fewer nested alternatives."
    )


async def collect(choices: Choices, count: int) -> list[list[RequestOutput]]:
    """Every output of each of `count` choices, for non-streaming responses. A choice that
    fails on its own fails the response (and ends the other choices)."""
    outputs: list[list[RequestOutput]] = [[] for _ in range(count)]
    try:
        async with contextlib.aclosing(choices):
            async for index, output in choices:
                if output.finish_reason == "error":
                    raise request_failure(output.error)
                outputs[index].append(output)
    except EngineError as exc:
        raise engine_failure(exc) from exc
    return outputs


async def sse_stream(
    choices: Choices,
    count: int,
    n: int,
    chunk: Callable[[int, RequestOutput], BaseModel | None],
    usage_chunk: Callable[[Usage], BaseModel] | None = None,
    head: Callable[[int], BaseModel] | None = None,
) -> AsyncIterator[str]:
    """SSE events: `head(i)` for each of the `count` choices, `chunk(i, output)` for each
    output (skipped when None), then the usage chunk if asked for, then `[DONE]`. An engine
    failure after the headers went out, or a choice that fails on its own, becomes an error
    event (the last before `[DONE]`), which the OpenAI clients raise."""
    try:
        async with contextlib.aclosing(choices):
            if head is not None:
                for index in range(count):
                    yield sse(head(index))
            lasts: dict[int, RequestOutput] = {}
            async for index, output in choices:
                if output.finish_reason == "error":
                    yield sse(request_failure(output.error).body())
                    yield DONE
                    return
                lasts[index] = output
                event = chunk(index, output)
                if event is not None:
                    yield sse(event)
        if usage_chunk is not None and lasts:
            yield sse(usage_chunk(usage_of([lasts[i] for i in sorted(lasts)], n)))
    except EngineError as exc:
        yield sse(engine_failure(exc).body())
    yield DONE


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
