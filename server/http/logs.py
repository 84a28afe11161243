"""Log lines that name their request: a request id per HTTP request, text or JSON output.

The id comes from the client's `X-Request-Id` header or is made up, is sent back in the
response's `X-Request-Id`, and is stamped on every record logged while the request is served
(uvicorn's access line included). The engine thread logs with `extra={"request_id": ...}`.
No two requests in flight share an id: a client's id already in use gets a random suffix,
so one client cannot pass its log lines off as another's.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from contextvars import ContextVar
from typing import Literal

from starlette.types import ASGIApp, Message, Receive, Scope, Send

LogFormat = Literal["text", "json"]

_request_id: ContextVar[str] = ContextVar("request_id", default="-")
_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"
# A client's id is stamped on every log line of its request: short, and no separators.
_CLIENT_ID = re.compile(r"[A-Za-z0-9._:/+=-]{1,128}")


def current_request_id() -> str:
    return _request_id.get()


class RequestIdFilter(logging.Filter):
    """Give every record a `request_id`: its own `extra`, else the request being served."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = _request_id.get()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line, for log shippers."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            "request_id": getattr(record, "request_id", "-"),
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def configure_logging(level: str, log_format: LogFormat = "text") -> None:
    """Route every logger (uvicorn's too, which must then run with `log_config=None`) to one
    stderr handler that stamps request ids."""
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdFilter())
    formatter = JsonFormatter() if log_format == "json" else logging.Formatter(_TEXT_FORMAT)
    handler.setFormatter(formatter)
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


class RequestIdMiddleware:
    """Bind a request id for the request's lifetime and return it as `X-Request-Id`."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._in_flight: set[str] = set()  # event loop only

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = _client_request_id(scope) or f"req-{uuid.uuid4().hex[:16]}"
        if request_id in self._in_flight:
            request_id = f"{request_id[:120]}~{uuid.uuid4().hex[:6]}"
        self._in_flight.add(request_id)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
                message = {**message, "headers": headers}
            await send(message)

        token = _request_id.set(request_id)
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            _request_id.reset(token)
            self._in_flight.discard(request_id)


def _client_request_id(scope: Scope) -> str | None:
    """The client's id when it is one token of a safe alphabet: spaces and brackets in it
    could forge what looks like another log line."""
    for name, value in scope.get("headers", []):
        if name == b"x-request-id":
            text = value.decode("latin-1")
            return text if _CLIENT_ID.fullmatch(text) else None
    return None
