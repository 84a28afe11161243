"""The `Host` header check: a server on a loopback address answers only requests made to a
loopback name.

A web page can point its own domain at 127.0.0.1 (DNS rebinding) and then call the local
server as "same origin", past CORS; its requests still say `Host: attacker.example`. Bound
elsewhere, the server accepts any Host unless `--allowed-hosts` names them.
"""

from __future__ import annotations

import ipaddress

from starlette.types import ASGIApp, Receive, Scope, Send

from server.http.errors import APIError

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def allowed_hosts(bind_host: str, extra: tuple[str, ...] = ()) -> frozenset[str] | None:
    """The host names requests may use, or None for any: the loopback names when the server
    binds a loopback address, plus `extra` (`--allowed-hosts`; "*" allows any)."""
    if "*" in extra:
        return None
    names = {name.lower().strip("[]") for name in extra}
    if _is_loopback(bind_host):
        names.update(LOOPBACK_NAMES)
    return frozenset(names) or None


def _is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """The name part of a Host header value: no port, no IPv6 brackets, lower case."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].partition("]")[0]
    return header.rpartition(":")[0] if header.count(":") == 1 else header


class HostCheck:
    """ASGI middleware: 400 (in the called API's error style) for a Host not in `allowed`."""

    def __init__(self, app: ASGIApp, allowed: frozenset[str]) -> None:
        self.app = app
        self.allowed = allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        header = next((v for k, v in scope["headers"] if k == b"host"), b"")
        if host_name(header.decode("latin-1")) in self.allowed:
            await self.app(scope, receive, send)
            return
        error = APIError(
            "The request's Host header names a host this server does not answer to; start "
            "it with --allowed-hosts NAME to accept requests made to that name.",
            code="invalid_host",
        )
        await error.response(scope["path"])(scope, receive, send)
