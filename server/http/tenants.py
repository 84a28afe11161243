"""The tenant (an API key's, see server.http.auth) of the request being served, and the key
it came in on.

A module of its own, importing nothing, so that the engine bridge can read it without
importing the HTTP layer that sets it.
"""

from __future__ import annotations

from contextvars import ContextVar

TENANT: ContextVar[str | None] = ContextVar("tenant", default=None)


def current_tenant() -> str | None:
    """None without keys, or with a prefix cache shared by all keys."""
    return TENANT.get()


# The key (as its tenant id) a request came in on, whatever the prefix cache shares: what
# is kept per key apart from the cache (stored responses) belongs to it. None without keys.
CALLER: ContextVar[str | None] = ContextVar("caller", default=None)


def current_caller() -> str | None:
    return CALLER.get()
