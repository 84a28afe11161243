"""Answer an HTTP request with one assistant turn, through an API's output builder: as named
SSE events while it runs, or as the builder's whole object at its end."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.requests import Request

from server.async_engine import EngineError
from server.core import engine_choices, turn_events
from server.core.turn_events import Turn, TurnEnd, TurnEvent
from server.http.sse import CLIENT_CLOSED, event_stream, sse

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
    turn = await engine_choices.unless_disconnected(request, start)
    if turn is None:
        return Response(status_code=CLIENT_CLOSED)
    builder = builder_for(turn)
    if stream:
        return event_stream(_stream(turn, builder))
    result = await engine_choices.unless_disconnected(request, _whole(turn, builder))
    if result is None:
        return Response(status_code=CLIENT_CLOSED)
    return JSONResponse(result.model_dump())


async def _whole(turn: Turn, builder: OutputBuilder) -> BaseModel:
    def add(event: TurnEvent) -> None:
        if _failed(event):
            raise engine_choices.request_failure()
        builder.add(event)

    await turn_events.consume(turn, add)
    return builder.result()


async def _stream(turn: Turn, builder: OutputBuilder) -> AsyncIterator[str]:
    for event in builder.start():
        yield sse(event, event["type"])
    try:
        async with contextlib.aclosing(turn):
            async for turn_event in turn.events:
                if _failed(turn_event):
                    for event in builder.fail(engine_choices.request_failure().message):
                        yield sse(event, event["type"])
                    return
                for event in builder.add(turn_event):
                    yield sse(event, event["type"])
    except EngineError as exc:
        for event in builder.fail(engine_choices.engine_failure(exc).message):
            yield sse(event, event["type"])


def _failed(event: TurnEvent) -> bool:
    """Whether the turn ended failed on its own (its grammar broke; see request_failure)."""
    return isinstance(event, TurnEnd) and event.finish_reason == "error"
