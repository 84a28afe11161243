"""Answer an HTTP request with one assistant turn, through an API's output builder: as named
SSE events while it runs, or as the builder's whole object at its end."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.requests import Request

from server.async_engine import EngineError
from server.core import assistant_turn, generation
from server.core.assistant_turn import Turn, TurnEvent

# Sent instead of a body when the client left before its non-streaming answer was ready.
CLIENT_CLOSED = 499
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

Event = dict[str, Any]  # its "type" is also the SSE event name


class OutputBuilder(Protocol):
    """Builds an API's answer from turn events; each call returns the stream events to send."""

    def start(self) -> list[Event]: ...

    def add(self, event: TurnEvent) -> list[Event]: ...

    def fail(self, message: str) -> list[Event]:
        """The engine failed after the stream began."""
        ...

    def result(self) -> BaseModel:
        """The whole answer, once the turn's last event went in."""
        ...


async def serve_turn(
    request: Request,
    start: Awaitable[Turn],
    builder_for: Callable[[Turn], OutputBuilder],
    stream: bool,
) -> Response:
    turn = await generation.unless_disconnected(request, start)
    if turn is None:
        return Response(status_code=CLIENT_CLOSED)
    builder = builder_for(turn)
    if stream:
        events = _stream(turn, builder)
        return StreamingResponse(events, media_type="text/event-stream", headers=_SSE_HEADERS)
    result = await generation.unless_disconnected(request, _whole(turn, builder))
    if result is None:
        return Response(status_code=CLIENT_CLOSED)
    return JSONResponse(result.model_dump())


async def _whole(turn: Turn, builder: OutputBuilder) -> BaseModel:
    await assistant_turn.consume(turn, builder.add)
    return builder.result()


async def _stream(turn: Turn, builder: OutputBuilder) -> AsyncIterator[str]:
    for event in builder.start():
        yield _sse(event)
    try:
        async with contextlib.aclosing(turn):
            async for turn_event in turn.events:
                for event in builder.add(turn_event):
                    yield _sse(event)
    except EngineError as exc:
        for event in builder.fail(str(exc)):
            yield _sse(event)


def _sse(event: Event) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"
