"""What the CPU backend's compiled loops (cpu_decode, cpu_gemm, cpu_layer, cpu_prefill)
share: their fast-math flags, how many threads a parallel loop may use, one launch at a time,
and Python threads for work that calls BLAS between loops."""

from __future__ import annotations

import importlib
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

import numba
from threadpoolctl import ThreadpoolController

log = logging.getLogger(__name__)

# IEEE-safe fast math: reassociated sums and contracted products, but -inf stays -inf (a
# running maximum starts there, and a sink of -inf must weigh 0).
FAST_MATH = {"nsz", "arcp", "contract", "afn", "reassoc"}

# numba's thread pools whose idle workers spin a while before they sleep. A one-request
# decode step launches ~120 parallel products tens of microseconds apart; these find their
# workers awake. The fallback pool (workqueue) wakes a sleeping worker at every launch: a
# decode step ran 3x slower on it than on one thread.
SPINNING_POOLS = {"omp": "omppool", "tbb": "tbbpool"}

# How long the OpenMP pool's workers spin: GNU OpenMP's default, 300k turns, is ~7.5 ms here,
# and a prefill's attention (Python threads calling BLAS right after a parallel product)
# shared a core with the spinning worker for most of each layer: a 256-row chunk at 1k keys
# 10.3 ms a layer's attention against 6.2. 30k turns (~0.75 ms) still spans the gaps between
# a step's parallel products (microseconds) and the host's work between steps. Read once,
# when the OpenMP library loads, which the pool probe below does: unless the user has chosen.
SPIN_COUNT = "30000"


def _spinning_pool_available() -> bool:
    chosen = numba.config.THREADING_LAYER
    candidates = [chosen] if chosen in SPINNING_POOLS else []
    if chosen in ("default", "safe", "threadsafe", "forksafe"):
        candidates = list(SPINNING_POOLS)
    for layer in candidates:
        try:  # how numba itself probes a pool: its module loads only if its library does
            importlib.import_module(f"numba.np.ufunc.{SPINNING_POOLS[layer]}")
            return True
        except ImportError:
            continue
    return False


def _available_threads() -> int:
    if numba.config.NUMBA_NUM_THREADS == 1 or _spinning_pool_available():
        return numba.config.NUMBA_NUM_THREADS
    if sys.platform.startswith("linux"):
        log.warning("numba has no OpenMP or TBB thread pool here, so the CPU backend's compiled "
                    "loops run on one thread. Install OpenMP: sudo apt-get install libgomp1")
    return 1


def _probed_with_spin_count() -> int:
    """`_available_threads()`, the OpenMP library loading with SPIN_COUNT unless the user
    set one; the environment is left as it was, so the processes this one starts (a
    llama-server that `bench compare` times beside it) run as their users run them."""
    if "GOMP_SPINCOUNT" in os.environ:
        return _available_threads()
    os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT
    try:
        return _available_threads()
    finally:
        del os.environ["GOMP_SPINCOUNT"]


_available = _probed_with_spin_count()
_threads = _available
# numba's workqueue pool takes one parallel launch at a time.
_launch = threading.Lock()
_launcher = threading.local()  # the thread count numba was last given on this thread
_pool_started = False


def threads() -> int:
    return _threads


def use_threads(count: int) -> None:
    """Threads a parallel loop may use (ranks that share the cores take their share)."""
    global _threads
    _threads = max(1, min(count, _available))


def compile_loop(parallel: bool) -> Callable[[Callable], Callable]:
    """Compile a loop with these flags, cached on disk, on one thread or `parallel` (its
    `numba.prange` spread over the threads).

    numba's disk cache tells functions apart by module, name, line and the values they close
    over, not by compile flags: the one-thread and the parallel build of one function would
    load each other's machine code (a 16-request decode step ran 1.6x slower on the
    one-thread tiles). Each build gets a name of its own.
    """
    def compile_(function: Callable) -> Callable:
        function.__qualname__ += ".parallel" if parallel else ".one_thread"
        return numba.njit(cache=True, fastmath=FAST_MATH, nogil=True, parallel=parallel,
                          boundscheck=False)(function)

    return compile_


def run(function: Callable, *args, parallel: bool = True):
    """`function(*args, parallel)`: compiled code that calls the parallel builds of its loops
    when `parallel` (run here on this process's share of the threads), else the one-thread
    ones; `parallel=False` where the work is too small to share. (Builds are chosen by a
    flag, not closed over: numba's disk cache cannot key a function by the compiled functions
    it closes over, and compiled it again each process.)"""
    if parallel and _threads > 1:
        return launch(function, *args, True)
    if not _pool_started:
        _start_pool()
    return function(*args, False)


def map_on_threads(function: Callable, items: Iterable) -> list:
    """`[function(item) for item in items]` on this process's share of the threads, from
    Python threads, for work that calls BLAS between compiled loops (which release the GIL).
    Meanwhile every BLAS runs its products on the calling thread: its own workers, spinning
    between products, would take the cores the other threads need."""
    global _blas
    if _blas is None:
        _blas = ThreadpoolController()
    executor = _executors.get(_threads)
    if executor is None:
        executor = _executors[_threads] = ThreadPoolExecutor(_threads, "cpu-threads")
    with _blas.limit(limits=1, user_api="blas"):
        return list(executor.map(function, items))


_executors: dict[int, ThreadPoolExecutor] = {}
_blas = None  # threadpoolctl's controller of the BLAS libraries loaded, made on first use


def _start_pool() -> None:
    # Such code loaded from the disk cache crashed (SIGSEGV) before numba's thread pool was
    # started, on its one-thread path too: the parallel loops linked into it need the pool's
    # entry points. A parallel launch starts the pool; on one thread this does.
    global _pool_started
    numba.get_num_threads()
    _pool_started = True


def launch(kernel: Callable, *args):
    """Run a kernel of a parallel build on this process's share of the threads."""
    with _launch:
        # numba's count is per thread, and setting it costs more than a small product's launch.
        if getattr(_launcher, "threads", None) != _threads:
            numba.set_num_threads(_threads)
            _launcher.threads = _threads
        return kernel(*args)
