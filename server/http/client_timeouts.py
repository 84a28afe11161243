"""`--client-timeout`: a client that trickles its request or stops reading its response is cut
off, so it cannot hold a connection, a request slot or the shutdown drain for ever.

Three deadlines of the same length, each measured from the step before it:
- the request's headers, from its first byte (or from the connection, for the first request):
  `TimedH11Protocol`, since uvicorn arms no timer until the headers are complete;
- its body, from the headers: `server.http.body_limit.RequestBody` answers 408;
- each write of the response: `ResponseDeadline` treats a client whose socket buffer stays
  full for that long as gone (uvicorn's `send` blocks while the client does not read).
"""

from __future__ import annotations

import asyncio
import contextlib

import h11
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, closing connections whose request headers do not arrive in
    time. uvicorn's keep-alive timer covers an idle connection, but stops at the first byte
    of the next request; this one runs from then until the headers are parsed."""

    header_timeout_s: float  # set per server by `server.http.connections.server_protocol`

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:  # still inside a request's headers
            self._arm_header_timer()
        else:
            self._cancel_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # arms uvicorn's keep-alive timer for the idle wait
        self._cancel_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


class _ClientGone(Exception):
    """Raised from `send` when a write waited past the deadline."""


class ResponseDeadline:
    """ASGI middleware: each response write must complete within `timeout_s`, else the
    request is dropped as if the client had disconnected (streaming handlers then abort
    their generation)."""

    def __init__(self, app: ASGIApp, timeout_s: float) -> None:
        self.app = app
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        gone = False

        async def gone_or_receive() -> Message:
            return {"type": "http.disconnect"} if gone else await receive()

        async def timed_send(message: Message) -> None:
            nonlocal gone
            if gone:
                raise _ClientGone
            try:
                await asyncio.wait_for(send(message), self.timeout_s)
            except asyncio.TimeoutError:
                gone = True
                raise _ClientGone from None

        # Nothing more can reach a client that is gone; uvicorn then closes the connection.
        with contextlib.suppress(_ClientGone):
            await self.app(scope, gone_or_receive, timed_send)
