"""Graceful shutdown: on SIGTERM (or a first Ctrl-C), drain, then let uvicorn exit.

    signal ──▶ Drain.run: new requests get 503 ──▶ wait for in-flight requests (up to the
    timeout) ──▶ abort the rest (their clients get finish_reason "abort") ──▶ uvicorn shuts
    down: lifespan end → AsyncEngine.shutdown → engine.close() on the engine thread ──▶ exit 0

uvicorn alone would close the listening socket at once, cut streams off at its own timeout,
and re-raise the signal after shutdown (so the process would die of SIGTERM, not exit 0).
A second signal falls through to uvicorn's own handling: a quick, unclean exit.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from types import FrameType
from typing import Protocol

import uvicorn
from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

from server.heap import freeze_startup_objects
from server.http.connections import (
    AcceptErrorSummary,
    default_max_connections,
    raise_open_file_limit,
    server_protocol,
)
from server.http.errors import APIError

log = logging.getLogger(__name__)

_POLL_S = 0.05
_ABORTED_REPLY_GRACE_S = 5.0  # for handlers to send the last "abort" chunk of each request


class Abortable(Protocol):
    """What a drain aborts once its time is up: an AsyncEngine, or every loaded model's."""

    def abort_all(self) -> None: ...


class Drain:
    """What a graceful shutdown waits for: the HTTP requests in flight (counted by `DrainGate`,
    which also turns new ones away once `draining`)."""

    def __init__(self, engine: Abortable) -> None:
        self.engine = engine
        self.draining = False
        self.in_flight = 0  # event loop only

    async def run(self, timeout_s: float) -> None:
        """Stop admitting, wait up to `timeout_s` for in-flight requests, abort the rest."""
        self.draining = True
        log.info("draining %d requests (up to %.0fs)", self.in_flight, timeout_s)
        if await self._idle_within(timeout_s):
            return
        log.warning("aborting %d requests still running after %.0fs", self.in_flight, timeout_s)
        self.engine.abort_all()
        if not await self._idle_within(_ABORTED_REPLY_GRACE_S):
            log.warning("%d requests did not finish after their abort", self.in_flight)

    async def _idle_within(self, timeout_s: float) -> bool:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self.in_flight and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(_POLL_S)
        return not self.in_flight


class DrainGate:
    """ASGI middleware: counts requests for `Drain`, and answers 503 while it drains."""

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.drain.draining:
            error = APIError(
                "The server is shutting down; retry on another instance or after the restart.",
                status_code=503, code="shutting_down", headers={"Connection": "close"},
            )  # fmt: skip
            await error.response(scope["path"])(scope, receive, send)
            return
        self.drain.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.in_flight -= 1


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose first SIGTERM or SIGINT drains the app before shutting down."""

    def __init__(self, config: uvicorn.Config, drain: Drain, timeout_s: float) -> None:
        super().__init__(config)
        self.drain = drain
        self.timeout_s = timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None

    async def serve(self, sockets: list | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.set_exception_handler(AcceptErrorSummary())
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.drain.draining or self._loop is None or sig not in _DRAIN_SIGNALS:
            super().handle_exit(sig, frame)
            return
        self.drain.draining = True  # before the handler returns: a second signal forces
        # A signal handler must not touch the loop's internals; this call is made for it.
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await self.drain.run(self.timeout_s)
        finally:
            self.should_exit = True


_DRAIN_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def run_server(
    app: FastAPI, host: str, port: int, log_level: str, timeout_s: float,
    client_timeout_s: float, max_connections: int | None = None,
) -> None:  # fmt: skip
    """Serve `app` (built by `build_app`) until a signal, then drain it (see the module doc);
    request headers must arrive within `client_timeout_s`; at most `max_connections` stay
    open (default: from the open-file limit, see server.http.connections)."""
    open_files = raise_open_file_limit()
    max_connections = max_connections or default_max_connections(open_files)
    log.info("open-file limit %d; at most %d connections", open_files, max_connections)
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level,
        log_config=None,  # keep `configure_logging`'s handler, which stamps request ids
        timeout_graceful_shutdown=_ABORTED_REPLY_GRACE_S,  # after our drain, only stragglers
        http=server_protocol(client_timeout_s, max_connections),
    )  # fmt: skip
    freeze_startup_objects()
    DrainingServer(config, app.state.drain, timeout_s).run()
