"""Log lines that name their request: a request id per HTTP request, text or JSON output.

The id comes from the client's `X-Request-Id` header or is made up, is sent back in the
response's `X-Request-Id`, and is stamped on every record logged while the request is served
(uvicorn's access line included). The engine thread logs with `extra={"request_id": ...}`.
No two requests in flight share an id: a client's id already in use gets a random suffix,
so one client cannot pass its log lines off as another's.

Without `--log-prompts` a logged exception keeps its type and its frames but not its message
(`TextFormatter`, `JsonFormatter`): the message of an error raised while handling a request
may quote what the client sent.
"""

from __future__ import annotations

import json
import logging
import re
import traceback
import uuid
from contextvars import ContextVar
from typing import IO, Literal

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


class TextFormatter(logging.Formatter):
    """The text line; with `withhold`, an exception's type and frames but not its message,
    nor those of its causes: one raised while serving a request (a tokenizer's, the
    engine's) may quote the prompt.

    The exception text is made for this handler alone: logging caches it on the record, where
    another handler (with other settings) would otherwise print this one's.
    """

    def __init__(self, fmt: str | None = None, withhold: bool = False) -> None:
        super().__init__(fmt)
        self.withhold = withhold

    def formatException(self, ei) -> str:  # noqa: N802 (logging's name)
        if self.withhold and ei and ei[1] is not None:
            return withheld_traceback(ei[1]).rstrip("\n")
        return super().formatException(ei)

    def format(self, record: logging.LogRecord) -> str:
        cached, record.exc_text = record.exc_text, None
        try:
            return self._format(record)
        finally:
            record.exc_text = cached

    def _format(self, record: logging.LogRecord) -> str:
        return super().format(record)


class JsonFormatter(TextFormatter):
    """One JSON object per line, for log shippers."""

    def _format(self, record: logging.LogRecord) -> str:
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


_WITHHELD = "(message withheld: it may quote a request; --log-prompts logs it)"


def withheld_traceback(exc: BaseException) -> str:
    """`exc`'s traceback as Python prints it, causes first, with each message withheld."""
    lines: list[str] = []
    seen: set[int] = set()
    chain: BaseException | None = exc
    while chain is not None and id(chain) not in seen:
        seen.add(id(chain))
        frames = traceback.format_list(traceback.extract_tb(chain.__traceback__))
        head = ["Traceback (most recent call last):\n"] if frames else []
        lines[:0] = [*head, *frames, f"{_type_name(chain)}: {_WITHHELD}\n"]
        if chain.__cause__ is not None:
            chain = chain.__cause__
            lines.insert(0, f"\n{_CAUSE}\n\n")
        elif chain.__context__ is not None and not chain.__suppress_context__:
            chain = chain.__context__
            lines.insert(0, f"\n{_CONTEXT}\n\n")
        else:
            chain = None
    return "".join(lines).lstrip("\n")


def _type_name(exc: BaseException) -> str:
    kind = type(exc)
    module = "" if kind.__module__ == "builtins" else f"{kind.__module__}."
    return module + kind.__qualname__


_CAUSE = "The above exception was the direct cause of the following exception:"
_CONTEXT = "During handling of the above exception, another exception occurred:"


def log_handler(
    log_format: LogFormat = "text", log_prompts: bool = False, stream: IO[str] | None = None
) -> logging.Handler:
    """The server's handler: stamps request ids, formats as asked, and withholds exception
    messages unless the operator asked for prompts in the log. `stream`: stderr if None."""
    handler = logging.StreamHandler(stream)
    handler.addFilter(RequestIdFilter())
    withhold = not log_prompts
    formatter = (JsonFormatter(withhold=withhold) if log_format == "json"
                 else TextFormatter(_TEXT_FORMAT, withhold=withhold))
    handler.setFormatter(formatter)
    return handler


def configure_logging(
    level: str, log_format: LogFormat = "text", log_prompts: bool = False
) -> None:
    """Route every logger (uvicorn's too, which must then run with `log_config=None`) to one
    stderr handler (`log_handler`)."""
    handler = log_handler(log_format, log_prompts)
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
