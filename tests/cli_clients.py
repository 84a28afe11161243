"""The agent CLIs (Claude Code, Codex, opencode) at the versions pinned in agent_clis/, installed
from npm on first use, so the end-to-end tests drive the real binaries users run; and how to
run one: an environment without the caller's own settings, and nothing left running after."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest

CLIS_DIR = Path(__file__).parent / "agent_clis"
# Variables that point these CLIs at another server, config or log level, or carry keys.
STEERING_PREFIXES = ("OPENAI_", "CODEX_", "ANTHROPIC_", "CLAUDE_", "OPENCODE_", "XDG_")
STEERING_NAMES = frozenset({"RUST_LOG"})


def cli_path(name: str) -> Path:
    """The CLI's executable (`claude`, `codex` or `opencode`), installing the pinned set once.
    The check and the install hold a lock: `npm ci` empties node_modules first, so a second
    pytest process must neither start one too nor run a binary while it is gone."""
    binary = CLIS_DIR / "node_modules" / ".bin" / name
    with open(CLIS_DIR / ".install.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not binary.exists():
            install_clis()
    return binary


def install_clis() -> None:
    npm = shutil.which("npm")
    if npm is None:
        pytest.fail("the agent CLI tests need Node.js and npm: apt-get install nodejs npm")
    subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=CLIS_DIR, check=True, timeout=600)


def cli_env(**settings: str) -> dict[str, str]:
    """The caller's environment less what would steer a CLI elsewhere or hand it real
    credentials, with `settings` on top (HOME and the like, per test)."""
    own = {
        key: value for key, value in os.environ.items()
        if not key.startswith(STEERING_PREFIXES) and key not in STEERING_NAMES
    }  # fmt: skip
    return {**own, **settings}


def run_cli(
    argv: Sequence[str], env: dict[str, str], cwd: Path, timeout: float
) -> subprocess.CompletedProcess:
    """Run a CLI in a process group of its own, so that neither a timeout nor a normal exit
    leaves its children (tool commands, servers it starts) running. Past `timeout` the test
    fails with what it printed so far. PWD follows `cwd`: opencode takes its project from it."""
    with subprocess.Popen(
        argv, env={**env, "PWD": str(cwd)}, cwd=cwd, stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    ) as process:  # fmt: skip
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(process.pid)
            stdout, stderr = process.communicate()
            pytest.fail(timeout_report(argv, timeout, process.returncode, stdout, stderr))
        finally:
            kill_group(process.pid)
    return subprocess.CompletedProcess(list(argv), process.returncode, stdout, stderr)


def kill_group(pgid: int) -> None:
    """SIGKILL whatever is left in the group; nothing left is the usual case."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def timeout_report(
    argv: Sequence[str], timeout: float, returncode: int, stdout: str, stderr: str
) -> str:
    """Whether the CLI itself was still running (or only something it started, holding its
    output open), and the tail of what it printed."""
    exited = f"; it had exited ({returncode}), not what it started" if returncode >= 0 else ""
    return (
        f"{Path(argv[0]).name} ran past {timeout} s{exited}\n"
        f"stdout:\n{stdout[-3000:]}\nstderr:\n{stderr[-3000:]}"
    )
