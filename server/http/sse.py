"""Server-sent events as every API here sends them, and the status logged for a client that
left before its answer was ready.

    chat, completions:     data: {chunk}\n\n ... data: [DONE]\n\n
    Responses, Anthropic:  event: {type}\ndata: {event}\n\n ...
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from starlette.types import Send

# nginx's "client closed request": it shows in the access log; the client is gone.
CLIENT_CLOSED = 499
DONE = "data: [DONE]\n\n"
_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(data: BaseModel | dict[str, Any], event: str | None = None) -> str:
    """One event: `data` as JSON, named `event` when the API names its events."""
    payload = data.model_dump_json() if isinstance(data, BaseModel) else json.dumps(data)
    return f"event: {event}\ndata: {payload}\n\n" if event else f"data: {payload}\n\n"


class _ClosingStreamingResponse(StreamingResponse):
    """Closes its events when the response ends, however it ends. Starlette leaves them
    suspended when a write fails (a client timed out by `ResponseDeadline`, a reset socket),
    and only a close runs their `finally`, which aborts the generation and frees its blocks."""

    async def stream_response(self, send: Send) -> None:
        events = self.body_iterator
        closing = (contextlib.aclosing(events) if isinstance(events, AsyncGenerator)
                   else contextlib.nullcontext())  # fmt: skip
        async with closing:
            await super().stream_response(send)


def event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    """The streaming response for `events`, unbuffered by proxies on the way; the events are
    closed when it ends."""
    return _ClosingStreamingResponse(events, media_type="text/event-stream", headers=_HEADERS)
