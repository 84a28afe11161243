"""LoRA deltas of a few host rows in compiled loops, for the host forward's layer steps.

After each targeted product a layer step (cpu_layer) adds every adapter row's delta
`(x @ A.T) @ B.T` to its output row, A `[r, in]` and B `[out, r]` its adapter's pair. The
rows of one adapter go together, as two of cpu_gemm's products (each adapter's pair read
once a step, not once a row); the adapters' runs are shared out over the threads. A
16-row decode step of four rank-16 adapters over SmolLM2-135M's every projection: ~5 ms of
these products beside the weights' ~22 (two AMD EPYC cores), where a loop over each row's
pair took ~9 and the runs on one thread ~6.5. Its reference is `Ops.low_rank` (MLX's
gathered products).

The pairs are the loaded adapters' stacks (metal_engine.lora.slots), laid out for these
products: `a [slots, r, in]`, `b [slots, out, r]` (`host_pair`), slot 0 the base's zeros.
"""

from __future__ import annotations

import numba
import numpy as np

from kernels_metal.cpu import gemm as cpu_gemm
from kernels_metal.cpu import threads as cpu_threads

NO_PAIR = np.zeros((0, 0, 0), np.float32)  # a projection no loaded adapter targets
# A step's adapter rows: (rows sorted by slot; where each slot's run of them starts, and
# their end; each run's slot). A step without adapter rows has no runs.
HostRows = tuple[np.ndarray, np.ndarray, np.ndarray]
NO_ROWS: HostRows = (np.zeros(0, np.int32), np.zeros(1, np.int32), np.zeros(0, np.int32))


def host_pair(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The products' layout of the stacks `a [slots, in, r]`, `b [slots, r, out]` (the
    gathered products'): `[slots, r, in]`, `[slots, out, r]`, copies."""
    return (np.ascontiguousarray(a.transpose(0, 2, 1)),
            np.ascontiguousarray(b.transpose(0, 2, 1)))


def host_rows(slot_of_row: np.ndarray) -> HostRows:
    """What `add` takes of a step's rows, from every row's slot (0: the base's)."""
    order = np.argsort(slot_of_row, kind="stable")
    order = order[slot_of_row[order] > 0]
    sorted_slots = slot_of_row[order]
    starts = np.flatnonzero(np.diff(sorted_slots, prepend=-1))
    return (order.astype(np.int32), np.append(starts, len(order)).astype(np.int32),
            sorted_slots[starts].astype(np.int32))


@numba.njit(cache=True, fastmath=cpu_threads.FAST_MATH, nogil=True, boundscheck=False)
def add(x, out, pair, rows, parallel):
    """`out[m] += (x[m] @ a[s].T) @ b[s].T` for each adapter row m of `rows` (`host_rows`),
    s its slot; float32 `x [rows, in]`, `out [rows, out]` (a view of a wider product's
    columns is fine), `pair` (a, b) of one linear (`NO_PAIR`s: nothing to add). On the
    threads when `parallel` (`cpu_threads.run`)."""
    a, b = pair
    if a.shape[0] == 0 or rows[0].shape[0] == 0:
        return
    if parallel:
        _parallel_runs(x, out, a, b, *rows)
    else:
        _runs(x, out, a, b, *rows)


def _runs_of(parallel: bool):
    @cpu_threads.compile_loop(parallel)
    def runs(x, out, a, b, order, starts, slots):
        for run in numba.prange(slots.shape[0]):  # each run its own rows of `out`
            first, count, s = starts[run], starts[run + 1] - starts[run], slots[run]
            rows = np.empty((count, x.shape[1]), np.float32)
            for i in range(count):
                rows[i] = x[order[first + i]]
            z = np.empty((count, a.shape[1]), np.float32)
            cpu_gemm.product(rows, a[s], z, False)
            delta = np.empty((count, b.shape[1]), np.float32)
            cpu_gemm.product(z, b[s], delta, False)
            for i in range(count):
                out[order[first + i]] += delta[i]

    return runs


_runs = _runs_of(parallel=False)
_parallel_runs = _runs_of(parallel=True)
