"""How a request body is read: whole, before any route sees it, under three limits.

- `--max-request-body`: a 413 at once when Content-Length is over it, else as soon as the
  body received grows past it (chunked uploads). (FastAPI's own `max_body_size` answers with
  a plain-text 413, which the API clients cannot parse.)
- `--client-timeout`: the body must arrive within that long of the headers, else a 408.
- `MAX_JSON_VALUES`: validating a body costs time on the event loop per JSON value, whatever
  the values are (a million small token ids took seconds, stalling every stream); bodies
  with more values get a 413 before they are parsed.

A body must also say it is JSON (`Content-Type: application/json`), else a 415: a web page
can post a body without that header to a local server without asking first (no CORS
preflight), so a keyless server would otherwise run any page's prompts.
"""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.http.client_presence import track_client
from server.http.errors import APIError, request_too_large

# Arrays, objects, strings and numbers all count. Room for a 128k-token prompt sent as ids,
# or ~500 tools with their schemas beside a long conversation.
MAX_JSON_VALUES = 1 << 17


def json_value_count(body: bytes) -> int:
    """How many values a JSON text holds (an empty array or object counts twice): one more
    than its commas and openings outside strings. A few C-speed passes over the bytes (a
    regular expression over the strings took ~30 ms for an 8 MB prompt, on the event loop)."""
    if not body.strip():
        return 0
    structure = _outside_strings(body)
    return structure.count(b",") + structure.count(b"[") + structure.count(b"{") + 1


def _outside_strings(body: bytes) -> bytes:
    """The body less its strings' contents. Escaped backslashes go first, pairing them from
    the left as JSON does, so that what is left of `\\"` is an escaped quote only when it was
    one; the quotes that remain then alternate opening and closing."""
    if b"\\" in body:
        body = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    return b"".join(body.split(b'"')[0::2])


def too_many_values(count: int) -> APIError:
    return APIError(
        f"The request body holds about {count} JSON values; at most {MAX_JSON_VALUES} are "
        "accepted. Send fewer items (messages, tools, token ids, logit_bias entries).",
        status_code=413,
        code="request_too_large",
    )


def not_json(content_type: str) -> APIError:
    return APIError(
        f"The request body must be JSON sent with Content-Type: application/json; got "
        f"{content_type or 'no Content-Type'}.",
        status_code=415, code="unsupported_media_type",
    )  # fmt: skip


def body_late(timeout_s: float) -> APIError:
    return APIError(
        f"The request body did not arrive within {timeout_s:g}s of its headers.",
        status_code=408,
        code="request_timeout",
        headers={"Connection": "close"},
    )


class _Refused(Exception):
    def __init__(self, error: APIError) -> None:
        super().__init__(error.message)
        self.error = error


class RequestBody:
    """ASGI middleware: read the whole body under the limits, then hand it to the app as
    one message (later `receive` calls, which wait for a disconnect, pass through)."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            if _content_length(scope) > self.max_bytes:
                raise _Refused(request_too_large())
            first = await self._read(receive, _header(scope, b"content-type"))
        except _Refused as refused:
            await refused.error.response(scope["path"])(scope, receive, send)
            return
        delivered = False

        async def replay() -> Message:
            nonlocal delivered
            if delivered:
                return await receive()
            delivered = True
            return first

        track_client(receive, len(first.get("body", b"")))
        await self.app(scope, replay, send)

    async def _read(self, receive: Receive, content_type: str) -> Message:
        """The body as one `http.request` message (or the disconnect that cut it short)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        chunks: list[bytes] = []
        received = 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), deadline - loop.time())
            except asyncio.TimeoutError:
                raise _Refused(body_late(self.timeout_s)) from None
            if message["type"] != "http.request":
                return message
            chunk = message.get("body", b"")
            received += len(chunk)
            if received > self.max_bytes:
                raise _Refused(request_too_large())
            chunks.append(chunk)
            if not message.get("more_body"):
                break
        body = b"".join(chunks)
        if body and not _is_json(content_type):
            raise _Refused(not_json(content_type))
        values = json_value_count(body)
        if values > MAX_JSON_VALUES:
            raise _Refused(too_many_values(values))
        return {"type": "http.request", "body": body, "more_body": False}


def _header(scope: Scope, name: bytes) -> str:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return ""


def _content_length(scope: Scope) -> int:
    value = _header(scope, b"content-length")
    return int(value) if value.isdigit() else 0  # uvicorn rejects malformed ones


def _is_json(content_type: str) -> bool:
    media_type = content_type.split(";", 1)[0].strip().lower()
    return media_type == "application/json" or media_type.endswith("+json")
