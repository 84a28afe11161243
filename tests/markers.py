"""Markers shared by the kernel tests."""

from __future__ import annotations

import sys

import pytest

from kernels_metal import emulator

# On Linux the emulator is how the Metal kernels are proven, so it is required there (without
# clang-19 those tests fail, naming it). Only a Mac may lack a clang that builds it: there
# `metal-serve doctor` checks the kernels on the GPU instead.
_MAC_REASON = emulator.unavailable_reason() if sys.platform == "darwin" else None
requires_emulator = pytest.mark.skipif(
    _MAC_REASON is not None,
    reason=f"{_MAC_REASON}; on a Mac `metal-serve doctor` checks the kernels on the GPU",
)
