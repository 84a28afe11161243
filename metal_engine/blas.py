"""Load an optimized BLAS before MLX on Linux.

The `mlx-cpu` wheel links a reference BLAS whose fp32 matmul is ~60x slower than OpenBLAS.
Loading OpenBLAS with RTLD_GLOBAL before `mlx.core` makes MLX bind to it instead.

OpenBLAS picks its kernels by CPU model; on a model newer than the library (common on cloud
VMs) it falls back to generic SSE3 kernels, ~3x slower than its AVX-512 ones. When the user
has not chosen a core type, one is chosen here from the CPU's feature flags.

OpenBLAS's workers spin after each call until 2^28 cycles (~90 ms) pass without another, and
the CPU backend's decode steps (compiled loops on the same cores) ran at 46 ms instead of 31
for the first steps after each prompt's prefill. Unless the user chose, they spin 2^22 cycles
(~1.5 ms): longer than the gaps between a prefill's products, shorter than a decode step.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

log = logging.getLogger(__name__)

CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)
INSTALL_HINT = "sudo apt-get install libopenblas0-pthread  (Debian/Ubuntu)"
WORKER_SPIN_LOG2_CYCLES = "22"

_loaded: str | None = None


def load_optimized_blas() -> str | None:
    """Load OpenBLAS globally if this is Linux and it exists; return its path or None."""
    global _loaded
    if _loaded is not None or not sys.platform.startswith("linux"):
        return _loaded
    if "mlx.core" in sys.modules:
        log.warning("mlx was imported before metal_engine; the optimized BLAS may not be used")
    if "OPENBLAS_CORETYPE" not in os.environ and (core := openblas_core_for_this_cpu()):
        os.environ["OPENBLAS_CORETYPE"] = core
    # Read when each OpenBLAS loads: MLX's below, numpy's at numpy's import.
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", WORKER_SPIN_LOG2_CYCLES)
    override = os.environ.get("METAL_SERVE_BLAS")
    for path in ((override,) if override else ()) + CANDIDATES:
        if os.path.exists(path):
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            _loaded = path
            return path
    log.warning(
        "No optimized BLAS found: fp32 matmul on the MLX CPU backend will be ~60x slower. "
        "Install one with: %s",
        INSTALL_HINT,
    )
    return None


def openblas_core_for_this_cpu() -> str | None:
    """The OpenBLAS kernel family the CPU's x86 feature flags support, or None to autodetect."""
    flags = _cpu_flags()
    if {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= flags:
        return "SKYLAKEX"
    if {"avx2", "fma"} <= flags:
        return "HASWELL"
    return None


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def blas_threads_for(ranks: int) -> int:
    """BLAS threads for each of `ranks` processes sharing this machine's cores: OpenBLAS
    threads spin while they wait, so more threads than cores starve the other ranks."""
    return max(1, usable_cores() // ranks)


def usable_cores() -> int:
    """Cores to spread this process's compute threads over.

    Linux: the CPUs its affinity mask allows (a container or `taskset` narrows it). macOS has
    no affinity mask; there it is the performance cores: a loop split into equal shares waits
    for its slowest one, and an efficiency core runs a share at half the speed or less.
    Elsewhere (or on an Intel Mac, which has one core type): every CPU.
    """
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    if sys.platform == "darwin" and (performance := _sysctl_int("hw.perflevel0.physicalcpu")):
        return performance
    return os.cpu_count() or 1


def _sysctl_int(name: str) -> int | None:
    """An integer of macOS's `sysctlbyname`, or None where the name or the call is missing."""
    sysctlbyname = getattr(ctypes.CDLL(None), "sysctlbyname", None)
    if sysctlbyname is None:
        return None
    sysctlbyname.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t),
                             ctypes.c_void_p, ctypes.c_size_t]
    value, size = ctypes.c_int(0), ctypes.c_size_t(ctypes.sizeof(ctypes.c_int))
    if sysctlbyname(name.encode(), ctypes.byref(value), ctypes.byref(size), None, 0) != 0:
        return None
    return value.value


def limit_blas_threads(threads: int) -> None:
    """Cap every BLAS this process has loaded (MLX's OpenBLAS, numpy's) at `threads`, and the
    CPU backend's compiled loops with them."""
    from threadpoolctl import threadpool_limits

    from kernels_metal.cpu import threads as cpu_threads

    threadpool_limits(limits=threads, user_api="blas")
    cpu_threads.use_threads(threads)
