"""`--api-key`: every `/v1/...` request must carry one of the keys, and each key is a tenant.

Accepted as `Authorization: Bearer KEY` (OpenAI clients) or `x-api-key: KEY` (Anthropic
clients) on any route. The dashboard's state (`/dashboard/state`: every live request, with
prompt text under --log-prompts) needs a key too; `/health`, `/metrics`, `/openapi.json` and the
dashboard page itself stay open: probes and scrapers carry no secrets, the metrics hold no
request content, and the page holds no data (it asks for the key and sends it in a header).

Tenants keep the prefix cache apart: a request is served with its key's tenant bound, and
`prefix_cache_salt` folds it into the salt of its prompts, so one key's `cached_tokens` (or
its speed) says nothing of what another key sent. Without keys, or with the cache shared
(`--prefix-cache-scope shared`), every client is one tenant.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Sequence

from starlette.types import ASGIApp, Receive, Scope, Send

from server.http.errors import APIError
from server.http.tenants import CALLER, TENANT

PROTECTED_PREFIX = "/v1/"
DASHBOARD_STATE_PATH = "/dashboard/state"
_HOW_TO_SEND = "send it as 'Authorization: Bearer <key>' or 'x-api-key: <key>'"



def tenant_id(api_key: str) -> str:
    """Names a key's tenant without holding the key. The same in every process, so the
    blocks a key left in the disk tier stay that key's after a restart."""
    digest = hashlib.blake2b(api_key.encode(), digest_size=16, person=b"metal-serve-tnt")
    return digest.hexdigest()


def prefix_cache_salt(cache_salt: str | None) -> str | None:
    """The salt of a prompt that the tenant being served sends with its own `cache_salt`:
    prompts share prefix-cache blocks only when both are equal. None when neither is set."""
    tenant = TENANT.get()
    if tenant is None and cache_salt is None:
        return None
    return json.dumps([tenant, cache_salt])


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
    """Answer 401 (in the called API's error style) unless a presented key is one of
    `api_keys`; serve the request with that key bound as its caller, and as its tenant
    (none with `share_prefix_cache`: all keys then share the prefix cache)."""

    def __init__(
        self, app: ASGIApp, api_keys: Sequence[str], share_prefix_cache: bool = False
    ) -> None:
        self.app = app
        self._keys = [key.encode() for key in api_keys]
        self._callers = [tenant_id(key) for key in api_keys]
        self._tenants = [None if share_prefix_cache else caller for caller in self._callers]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _is_protected(scope["path"]):
            await self.app(scope, receive, send)
            return
        presented = presented_keys(scope["headers"])
        index = self._matching_key(presented)
        if index is not None:
            tenant, caller = TENANT.set(self._tenants[index]), CALLER.set(self._callers[index])
            try:
                await self.app(scope, receive, send)
            finally:
                TENANT.reset(tenant)
                CALLER.reset(caller)
            return
        problem = "Invalid API key" if presented else "Missing API key"
        error = APIError(f"{problem}: {_HOW_TO_SEND}.", status_code=401, code="invalid_api_key")
        await error.response(scope["path"])(scope, receive, send)

    def _matching_key(self, presented: list[bytes]) -> int | None:
        """Index of the key that the first matching presented key is. compare_digest runs on
        every pair, so timing tells nothing about which key or how much of one matched."""
        matches = [
            index for key in presented for index, known in enumerate(self._keys)
            if hmac.compare_digest(key, known)
        ]  # fmt: skip
        return matches[0] if matches else None


def _is_protected(path: str) -> bool:
    return path.startswith(PROTECTED_PREFIX) or path == DASHBOARD_STATE_PATH
