"""A server as a subprocess on a free port: start it, wait until it answers, stop it."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

READY_PATHS = ("/v1/models", "/health")
STOP_GRACE_S = 20.0


def free_port() -> int:
    """A port nothing listens on right now (the server binds it a moment later)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def running_server(
    command: list[str],
    base_url: str,
    log_path: Path,
    timeout_s: float = 600.0,
    env: dict[str, str] | None = None,
) -> Iterator[subprocess.Popen]:
    """Run `command` (its output to `log_path`) until the block ends; raises a RuntimeError
    with the log's tail if it exits or is not ready within `timeout_s`."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as log:
        # A session of its own, so stopping it also stops any workers it started.
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            wait_ready(process, base_url, log_path, timeout_s)
            yield process
        finally:
            stop(process)


def wait_ready(process: subprocess.Popen, base_url: str, log_path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(
                f"the server exited with code {process.returncode} before it was ready; "
                f"its log ({log_path}) ends with:\n{log_tail(log_path)}"
            )
        for path in READY_PATHS:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(base_url + path, timeout=5.0).status_code == 200:
                    return
        time.sleep(1.0)
    raise RuntimeError(
        f"the server was not ready after {timeout_s:.0f} s; raise --server-timeout if it is "
        f"still loading. Its log ({log_path}) ends with:\n{log_tail(log_path)}"
    )


def stop(process: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, SIGKILL if it lingers."""
    if process.poll() is not None:
        return
    for sig, wait_s in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(wait_s)
            return


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
