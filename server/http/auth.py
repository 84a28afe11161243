"""`--api-key`: every `/v1/...` request must carry the key.

Accepted as `Authorization: Bearer KEY` (OpenAI clients) or `x-api-key: KEY` (Anthropic
clients) on any route. `/health`, `/metrics` and the API docs stay open: probes and scrapers
carry no secrets and the metrics hold no request content.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from server.http.errors import APIError

PROTECTED_PREFIX = "/v1/"
_HOW_TO_SEND = "send it as 'Authorization: Bearer <key>' or 'x-api-key: <key>'"


def presented_keys(headers: list[tuple[bytes, bytes]]) -> list[bytes]:
    """The keys a request offers: its first `Authorization: Bearer` and its first `x-api-key`
    header (more would let one request try many keys)."""
    keys: dict[bytes, bytes] = {}
    for name, value in headers:
        if name == b"authorization" and value[:7].lower() == b"bearer ":
            keys.setdefault(name, value[7:].strip())
        elif name == b"x-api-key":
            keys.setdefault(name, value.strip())
    return list(keys.values())


class ApiKeyAuth:
    """Answer 401 (in the called API's error style) unless a presented key matches."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(PROTECTED_PREFIX):
            await self.app(scope, receive, send)
            return
        # compare_digest on every key, so timing tells nothing about how much of one matched.
        matches = [hmac.compare_digest(key, self._key) for key in presented_keys(scope["headers"])]
        if any(matches):
            await self.app(scope, receive, send)
            return
        problem = "Invalid API key" if matches else "Missing API key"
        error = APIError(f"{problem}: {_HOW_TO_SEND}.", status_code=401, code="invalid_api_key")
        await error.response(scope["path"])(scope, receive, send)
