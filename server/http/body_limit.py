"""`--max-request-body`: a 413 with the API's error body for request bodies over a size.

(FastAPI's own `max_body_size` answers an oversized Content-Length with a plain-text 413, which
the API clients cannot parse.)
"""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.http.errors import request_too_large


class _BodyTooLarge(HTTPException):
    """Raised from `receive`: FastAPI lets HTTP exceptions through body parsing, and the
    error handlers turn them into the 413 body."""

    def __init__(self) -> None:
        super().__init__(status_code=413)


class BodySizeLimit:
    """413 at once when Content-Length is over `max_bytes`, else as soon as the body received
    grows past it (chunked uploads)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if _content_length(scope) > self.max_bytes:
            await request_too_large().response(scope["path"])(scope, receive, send)
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise _BodyTooLarge
            return message

        await self.app(scope, counting_receive, send)


def _content_length(scope: Scope) -> int:
    for name, value in scope["headers"]:
        if name == b"content-length":
            return int(value) if value.isdigit() else 0  # uvicorn rejects malformed ones
    return 0
