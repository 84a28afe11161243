"""`metal-serve doctor --report FILE`: one self-contained Markdown file to attach to a bug
report: the machine (macOS version and chip on a Mac), MLX, the emulator's compiler, every
line the checks printed (verdicts and numbers), and what could not run on this machine."""

from __future__ import annotations

import contextlib
import io
import platform
import sys
from collections.abc import Callable
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import mlx.core as mx

EXIT_MEANINGS = {0: "every check passed", 1: "a check FAILED",
                 2: "the Metal kernels could not run on this machine"}


def machine_facts() -> list[tuple[str, str]]:
    """(what, value) pairs describing this machine and the software doctor ran on."""
    facts = [("system", f"{platform.system()} {platform.release()} ({platform.machine()})")]
    if mac := platform.mac_ver()[0]:
        facts.append(("macOS", mac))
    facts += [("python", sys.version.split()[0]), ("mlx", mx.__version__),
              ("metal-serve", _package_version("metal-serve")),
              ("Metal", "available" if mx.metal.is_available() else "not available"),
              ("default device", str(mx.default_device())),
              # The chip (e.g. "Apple M3 Pro") and GPU architecture on a Mac.
              ("device", device_info()),
              ("MSL emulator", _emulator_status())]
    return facts


def device_info() -> str:
    """`mx.device_info()` as one line, byte counts in GiB."""
    def shown(value) -> str:
        big = isinstance(value, int) and value > 2**24
        return f"{value / 2**30:.1f} GiB" if big else str(value)

    return ", ".join(f"{k} {shown(v)}" for k, v in sorted(mx.device_info().items()))


def machine_line() -> str:
    return "Machine: " + "; ".join(f"{what} {value}" for what, value in machine_facts())


def write_report(path: Path, command: str, run: Callable[[list[str]], int]) -> int:
    """Run `run(missing)` with its output shown and kept, then write the report to `path`.
    `run` appends to `missing` what could not run here and returns doctor's exit code."""
    path = Path(path)
    try:
        path.write_text("")  # a path that cannot be written fails now, not after the checks
    except OSError as exc:
        raise SystemExit(f"metal-serve doctor: cannot write the report to {path}: "
                         f"{exc.strerror or exc}") from exc
    kept = io.StringIO()
    missing: list[str] = []
    with contextlib.redirect_stdout(_Tee(sys.stdout, kept)):
        code = run(missing)
    path.write_text(render(command, code, machine_facts(), missing, kept.getvalue()))
    print(f"Report written to {path}: attach it to the bug report.")
    return code


def render(command: str, code: int, facts: list[tuple[str, str]], missing: list[str],
           output: str) -> str:
    lines = ["# metal-serve doctor report", "",
             f"- command: `{command}`",
             f"- written: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC",
             f"- result: exit code {code}, {EXIT_MEANINGS.get(code, 'unknown')}",
             "", "## Machine", "", "| | |", "|---|---|"]
    lines += [f"| {what} | {value.replace('|', '/')} |" for what, value in facts]
    lines += ["", "## Could not run here", ""]
    lines += [f"- {item}" for item in missing] or ["Nothing: every check ran."]
    lines += ["", "## Output", "", "```text", output.rstrip("\n"), "```", ""]
    return "\n".join(lines)


class _Tee(io.TextIOBase):
    def __init__(self, *streams) -> None:
        self.streams = streams

    def write(self, text: str) -> int:
        for stream in self.streams:
            stream.write(text)
        return len(text)

    def flush(self) -> None:
        for stream in self.streams:
            stream.flush()


def _package_version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed as a package (run from a source tree)"


def _emulator_status() -> str:
    from kernels_metal import emulator

    reason = emulator.unavailable_reason()
    return f"unavailable: {reason}" if reason else f"builds kernels with {emulator.find_clang()}"
