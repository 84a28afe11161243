"""How many connections the server holds open, so that a flood of idle ones cannot take it
down: every connection is a file descriptor, and a process out of them can neither accept
`/health` nor write the disk cache.

- At start, the soft limit on open files is raised to what the hard limit allows (macOS
  starts processes at 256); `--max-connections` defaults to half of it, the rest left to
  model files, the disk cache and logs.
- A connection past the cap closes the longest-idle one (a connection that never sent a
  request first, then keep-alive ones between requests); when every connection is busy with
  a request, the newcomer gets a 503 and is closed.
- asyncio logs a failed `accept()` once per retry; those lines are summarized once a minute.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from typing import Any

import h11

from server.http.client_timeouts import TimedH11Protocol

log = logging.getLogger(__name__)

# Past this, a local server gains nothing; macOS refuses a soft limit above OPEN_MAX (10240).
_TARGET_OPEN_FILES = 10240
_RESERVED_FILES_SHARE = 2  # connections get at most 1/2 of the open-file limit
_ACCEPT_LOG_EVERY_S = 60.0
_BUSY_BODY = (
    b'{"error":{"message":"The server holds its most connections, all busy; retry shortly.",'
    b'"type":"server_error","param":null,"code":"too_many_connections"}}'
)
_BUSY_REPLY = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
    b"retry-after: 1\r\nconnection: close\r\ncontent-length: %d\r\n\r\n" % len(_BUSY_BODY)
    + _BUSY_BODY
)


def raise_open_file_limit() -> int:
    """Raise this process's soft limit on open files toward the hard limit; the limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = _TARGET_OPEN_FILES if hard == resource.RLIM_INFINITY else min(hard,
                                                                           _TARGET_OPEN_FILES)
    if wanted > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError) as exc:  # e.g. a sandbox that forbids it
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, wanted,
                        exc)
    return soft


def default_max_connections(open_file_limit: int) -> int:
    return max(16, open_file_limit // _RESERVED_FILES_SHARE)


class CappedH11Protocol(TimedH11Protocol):
    """The server's HTTP protocol: header deadlines (TimedH11Protocol) and a cap on open
    connections, enforced as each new one arrives (see the module doc)."""

    max_connections: int  # set per server by `server_protocol`

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.opened_at = self.loop.time()
        self.responses_sent = 0
        super().connection_made(transport)
        if len(self.connections) <= self.max_connections:
            return
        victim = _longest_idle(self.connections, exclude=self)
        if victim is not None:
            victim.transport.close()
        else:
            transport.write(_BUSY_REPLY)
            transport.close()

    def on_response_complete(self) -> None:
        self.responses_sent += 1
        super().on_response_complete()

    def is_idle(self) -> bool:
        """Between requests: nothing of a request received, no response owed."""
        cycle = self.cycle
        return self.conn.their_state is h11.IDLE and (cycle is None or cycle.response_complete)


def _longest_idle(connections: Any, exclude: CappedH11Protocol) -> CappedH11Protocol | None:
    idle = [c for c in connections
            if c is not exclude and isinstance(c, CappedH11Protocol) and c.is_idle()
            and not c.transport.is_closing()]
    # Connections that never sent a request go first: that is what a flood looks like.
    return min(idle, key=lambda c: (c.responses_sent > 0, c.opened_at), default=None)


def server_protocol(header_timeout_s: float, max_connections: int) -> type[CappedH11Protocol]:
    """The protocol class for `uvicorn.Config(http=...)`."""
    attributes = {"header_timeout_s": header_timeout_s, "max_connections": max_connections}
    return type("CappedH11Protocol", (CappedH11Protocol,), attributes)


class AcceptErrorSummary:
    """A loop exception handler: `accept()` failures (out of file descriptors, say) logged
    once, then counted and summarized each minute instead of once per retry."""

    def __init__(self) -> None:
        self.suppressed = 0
        self.last_logged_at: float | None = None

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if "accept" not in str(context.get("message", "")):
            loop.default_exception_handler(context)
            return
        now = loop.time()
        if self.last_logged_at is not None and now - self.last_logged_at < _ACCEPT_LOG_EVERY_S:
            self.suppressed += 1
            return
        more = f" ({self.suppressed} more since the last report)" if self.suppressed else ""
        log.error("cannot accept connections: %s%s; raise the open-file limit (ulimit -n) or "
                  "lower --max-connections", context.get("exception"), more)
        self.last_logged_at, self.suppressed = now, 0
