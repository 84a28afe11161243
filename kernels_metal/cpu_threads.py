"""What the CPU backend's compiled loops (cpu_decode, cpu_gemm) share: their fast-math
flags, how many threads a parallel loop may use, and one launch at a time."""

from __future__ import annotations

import threading
from collections.abc import Callable

import numba

# IEEE-safe fast math: reassociated sums and contracted products, but -inf stays -inf (a
# running maximum starts there, and a sink of -inf must weigh 0).
FAST_MATH = {"nsz", "arcp", "contract", "afn", "reassoc"}

_threads = numba.config.NUMBA_NUM_THREADS
# numba's default thread pool (workqueue) takes one parallel launch at a time.
_launch = threading.Lock()


def threads() -> int:
    return _threads


def use_threads(count: int) -> None:
    """Threads a parallel loop may use (ranks that share the cores take their share)."""
    global _threads
    _threads = max(1, min(count, numba.config.NUMBA_NUM_THREADS))


def launch(kernel: Callable, *args) -> None:
    """Run a kernel compiled with `parallel=True` on this process's share of the threads."""
    with _launch:
        numba.set_num_threads(_threads)
        kernel(*args)
