"""MSL emulation harness: runs `mx.fast.metal_kernel` sources on the CPU via clang (tests only).

Importing this package needs no compiler; the first kernel call does (clang 19 on Linux, a
recent Apple clang or Homebrew's on a Mac: `unavailable_reason` says why one cannot).
"""

from kernels_metal.emulator.build import MSLCompileError, find_clang, unavailable_reason
from kernels_metal.emulator.kernel import (
    EmulatedKernel,
    KernelFault,
    OutOfBoundsError,
    RaceError,
    metal_kernel,
)
from kernels_metal.emulator.translate import MSLUnsupportedError

__all__ = [
    "EmulatedKernel",
    "KernelFault",
    "MSLCompileError",
    "MSLUnsupportedError",
    "OutOfBoundsError",
    "RaceError",
    "available",
    "find_clang",
    "metal_kernel",
    "unavailable_reason",
]


def available() -> bool:
    """True when a clang that can build emulated kernels is on PATH."""
    return unavailable_reason() is None
