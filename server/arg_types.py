"""Command-line value types shared by the commands: sizes, counts, seconds, lists. Each
raises `argparse.ArgumentTypeError`, which argparse reports against its option."""

from __future__ import annotations

import argparse
import re

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip


def parse_size(text: str) -> int:
    """Bytes from "2GiB", "512MB", "1.5gib" or a plain byte count."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"invalid size {text!r}: use bytes or a number with B, KB, MB, GB, KiB, MiB or GiB"
        )
    size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return size


def _int_at_least(minimum: int, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
    return value


def positive_int(text: str) -> int:
    return _int_at_least(1, text)


def non_negative_int(text: str) -> int:
    return _int_at_least(0, text)


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more seconds, got {text!r}")
    return value


def positive_seconds(text: str) -> float:
    value = seconds(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be more than 0 seconds")
    return value


def comma_list(text: str) -> tuple[str, ...]:
    """The non-empty items of a comma-separated list, stripped."""
    return tuple(item.strip() for item in text.split(",") if item.strip())
