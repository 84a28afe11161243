"""The agent CLIs (Claude Code, Codex, opencode) at the versions pinned in agent_clis/, installed
from npm on first use, so the end-to-end tests drive the real binaries users run."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

CLIS_DIR = Path(__file__).parent / "agent_clis"


def cli_path(name: str) -> Path:
    """The CLI's executable (`claude`, `codex` or `opencode`), installing the pinned set once."""
    binary = CLIS_DIR / "node_modules" / ".bin" / name
    if not binary.exists():
        npm = shutil.which("npm")
        if npm is None:
            pytest.fail("the agent CLI tests need Node.js and npm: apt-get install nodejs npm")
        subprocess.run(
            [npm, "ci", "--no-audit", "--no-fund"], cwd=CLIS_DIR, check=True, timeout=600
        )
    return binary
