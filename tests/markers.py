"""Markers shared by the kernel tests."""

from __future__ import annotations

import sys

import pytest

from kernels_metal import emulator

# On Linux the emulator is how the Metal kernels are proven, so it is required there (without
# clang-19 those tests fail, naming it). Only a Mac may lack it: `metal-serve doctor` checks the
# kernels on its GPU instead.
requires_emulator = pytest.mark.skipif(
    sys.platform == "darwin" and not emulator.available(),
    reason="the MSL emulator needs clang-19; on a Mac run `metal-serve doctor`",
)
