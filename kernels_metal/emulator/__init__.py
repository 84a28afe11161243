"""MSL emulation harness: runs `mx.fast.metal_kernel` sources on the CPU via clang (tests only).

Importing this package needs no compiler; the first kernel call does (clang 19).
"""

from kernels_metal.emulator.build import MSLCompileError, find_clang
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
    "metal_kernel",
]


def available() -> bool:
    """True when a clang that can build emulated kernels is on PATH."""
    return find_clang() is not None
