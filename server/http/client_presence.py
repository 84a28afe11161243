"""What a handler knows of its client before it sends a byte back: how large the request
body was, and whether the client is still connected.

uvicorn reports a disconnect only through `receive`, which nothing reads while a handler
renders and tokenizes a prompt; work queued for a client that hung up would otherwise run
for nobody. `RequestBody` records the request here as it reads the body.
"""

from __future__ import annotations

import asyncio
from contextvars import ContextVar
from typing import NamedTuple

from starlette.types import Receive


class ClientGone(Exception):
    """The client disconnected before its request's work started; nobody reads an answer."""


class _Client(NamedTuple):
    receive: Receive
    body_bytes: int


_CLIENT: ContextVar[_Client | None] = ContextVar("client", default=None)


def track_client(receive: Receive, body_bytes: int) -> None:
    """Record the current request's `receive` (after its body) and its body's size."""
    _CLIENT.set(_Client(receive, body_bytes))


def request_body_bytes() -> int:
    """The current request body's size; 0 outside a request read by `RequestBody`."""
    client = _CLIENT.get()
    return 0 if client is None else client.body_bytes


async def client_gone() -> None:
    """Return once the current request's client has disconnected (never, outside one)."""
    client = _CLIENT.get()
    if client is None:
        await asyncio.Event().wait()
        return
    while (await client.receive())["type"] != "http.disconnect":
        pass
