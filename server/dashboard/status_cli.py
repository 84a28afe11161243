"""`metal-serve status`: what a running server is doing, once or `--watch`ing it.

Reads `GET /dashboard/state` with the standard library only (no MLX, no HTTP client
package), so it starts at once and works from any install. Every failure is one line that
names the problem and the fix, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import time
import urllib.error
import urllib.request
from urllib.parse import quote, urlsplit

from server.dashboard import SCHEMA
from server.dashboard.status_text import format_status
from server.serve_args import API_KEY_ENV

DEFAULT_URL = "http://127.0.0.1:8000"
_CLEAR = "\x1b[H\x1b[2J"


class StatusError(RuntimeError):
    """The server could not be read; `transient` ones (not reachable) are worth a retry."""

    def __init__(self, message: str, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient


def add_status_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=DEFAULT_URL,
                        help=f"the server's base URL (default: {DEFAULT_URL})")
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                        help=f"one of the server's --api-key keys (default: ${API_KEY_ENV})")
    parser.add_argument("--model", metavar="NAME",
                        help="on a server of several models, the one to show (default: its "
                        "default model, else the first loaded)")
    parser.add_argument("--watch", action="store_true", help="refresh until interrupted")
    parser.add_argument("--interval", type=float, default=2.0,
                        help="seconds between refreshes with --watch (default: 2)")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds per request")


def run_status(args: argparse.Namespace) -> int:
    """0 once printed (or on Ctrl-C while watching); 1 if the server could not be read;
    2 for bad arguments."""
    try:
        url = base_url(args.url)
        if args.interval <= 0 or args.timeout <= 0:
            raise ValueError("--interval and --timeout must be positive")
    except ValueError as exc:
        return _fail(str(exc), 2)
    try:
        if not args.watch:
            print(format_status(fetch_state(url, args.api_key, args.timeout, args.model), url))
            return 0
        return _watch(url, args)
    except StatusError as exc:
        return _fail(str(exc), 1)
    except KeyboardInterrupt:
        return 0


def base_url(text: str) -> str:
    """The server's root URL from what the user typed (a trailing / or /v1 is dropped)."""
    parts = urlsplit(text.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--url {text!r} is not an http(s) URL; give the server's address, "
                         f"e.g. --url {DEFAULT_URL}")
    try:
        parts.port  # noqa: B018 (raises on a port that is not a number)
    except ValueError:
        raise ValueError(f"--url {text!r} has a bad port; e.g. --url {DEFAULT_URL}") from None
    path = parts.path.rstrip("/")
    path = path[: -len("/v1")] if path.endswith("/v1") else path
    return f"{parts.scheme}://{parts.netloc}{path}"


def fetch_state(url: str, api_key: str | None, timeout: float, model: str | None = None) -> dict:
    """The server's dashboard JSON (of `model`, on a server of several); a `StatusError`
    saying what went wrong and what to do."""
    query = "" if model is None else f"?model={quote(model)}"
    request = urllib.request.Request(f"{url}/dashboard/state{query}")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            body = response.read()
    except urllib.error.HTTPError as exc:
        raise StatusError(_http_problem(url, exc.code, api_key, model)) from None
    except (urllib.error.URLError, OSError) as exc:
        raise StatusError(_unreachable(url, exc, timeout), transient=True) from None
    try:
        state = json.loads(body)
    except ValueError:
        state = None
    if not isinstance(state, dict) or state.get("schema") != SCHEMA:
        found = state.get("schema") if isinstance(state, dict) else None
        raise StatusError(
            f"{url}/dashboard/state did not return the dashboard's {SCHEMA} JSON"
            + (f" (it speaks {found}: use a matching metal-serve)" if found else "")
            + "; is --url a metal-serve server?"
        )
    return state


def _watch(url: str, args: argparse.Namespace) -> int:
    """Redraw every `--interval` seconds; a server that goes away is retried."""
    clear = _CLEAR if sys.stdout.isatty() else ""
    # Ctrl-C ends the watch even when this process started with SIGINT ignored, as commands
    # started in the background by a non-interactive shell are.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    while True:
        try:
            text = format_status(fetch_state(url, args.api_key, args.timeout, args.model), url)
        except StatusError as exc:
            if not exc.transient:
                raise
            text = f"metal-serve status: {exc} (retrying every {args.interval:g}s)"
        print(f"{clear}{text}\n", flush=True)
        time.sleep(args.interval)


def _http_problem(url: str, code: int, api_key: str | None, model: str | None) -> str:
    if code == 401 and api_key:
        return (f"the server at {url} refused the API key: pass one of the keys it was "
                f"started with (--api-key, or ${API_KEY_ENV})")
    if code == 401:
        return (f"the server at {url} needs an API key: pass --api-key KEY or set "
                f"${API_KEY_ENV}")
    if code == 404 and model is not None:
        return (f"the server at {url} serves no model {model!r}: GET {url}/v1/models lists "
                "them")
    if code == 404:
        return (f"{url} has no /dashboard/state (HTTP 404): is --url a metal-serve server, "
                "of a version with `metal-serve status`?")
    return f"{url}/dashboard/state answered HTTP {code}; the server's log says why"


def _unreachable(url: str, exc: BaseException, timeout: float) -> str:
    reason = getattr(exc, "reason", exc)
    if isinstance(reason, socket.gaierror):
        return f"cannot resolve the host of {url}; check --url"
    if isinstance(reason, TimeoutError):
        return f"{url} did not answer within {timeout:g}s; is the server stuck, or --url wrong?"
    if isinstance(reason, ConnectionRefusedError):
        why = "connection refused"
    else:
        why = str(reason) or type(reason).__name__
    return (f"no server answers at {url} ({why}): start one with `metal-serve serve`, or "
            "pass --url with the address it listens on")


def _fail(message: str, code: int) -> int:
    print(f"metal-serve status: error: {message}", file=sys.stderr)
    return code
