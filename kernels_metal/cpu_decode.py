"""Decode attention for MLX's CPU backend: compiled loops that read the paged pools in place.

numpy's path (cpu_attention) gathers each request's blocks into fresh arrays and hands BLAS
one tiny product per request and KV head, each paying microseconds of call and thread
hand-off: 2.4 ms of a one-request decode step of the default model and ~30 ms of a
16-request one. These loops, compiled by numba once per head layout (and cached on disk),
score each decode row against its keys where the pool holds them, take the softmax and sum
the values: one pass over each key and value of a float32 pool.

Large steps (long contexts, many requests) run in parallel; a context too long to share out
by request and KV head is cut into key ranges whose partial sums are merged by their softmax
maxima, as flash-decoding does.
"""

from __future__ import annotations

import functools
import math
import threading

import numba
import numpy as np

# Below this many keys x KV heads in a step one thread does the whole step: waking a second
# costs more than it saves.
PARALLEL_FROM = 1 << 15
# Jobs (request x KV head x key range) a parallel step is cut into at least, per thread.
JOBS_PER_THREAD = 4
# IEEE-safe fast math: reassociated sums and contracted products, but -inf stays -inf (the
# running maximum starts there, and a sink of -inf must weigh 0).
FAST_MATH = {"nsz", "arcp", "contract", "afn", "reassoc"}

_threads = numba.config.NUMBA_NUM_THREADS
# numba's default thread pool takes one parallel launch at a time.
_parallel_launch = threading.Lock()


def use_threads(threads: int) -> None:
    """Threads a parallel step may use (ranks that share the cores take their share)."""
    global _threads
    _threads = max(1, min(threads, numba.config.NUMBA_NUM_THREADS))


def attend(queries: np.ndarray, keys: np.ndarray, values: np.ndarray, rows: np.ndarray,
           tables: np.ndarray, seq_lens: np.ndarray, first_keys: np.ndarray, scale: float,
           softcap: float | None, sinks: np.ndarray | None, out: np.ndarray) -> None:
    """Rows `rows` of `queries [total_q, H, D]` (one per decode request) attend to keys
    `first_keys[r]..seq_lens[r] - 1` of their block table `tables[r]` in the float32 pools
    `[blocks, block_size, kv_heads, D]`; their outputs go to the same rows of `out`."""
    kv_heads, head_dim = keys.shape[2], keys.shape[3]
    work = int((seq_lens - first_keys).sum()) * kv_heads
    parallel = work >= PARALLEL_FROM and _threads > 1
    splits = split_count(len(rows), kv_heads) if parallel else 1
    kernel = _kernel(queries.shape[1] // kv_heads, head_dim, keys.shape[1], parallel)
    args = (queries, keys, values, rows, tables, seq_lens, first_keys, splits, np.float32(scale),
            np.float32(softcap or 0.0), np.zeros(0, np.float32) if sinks is None else sinks, out)
    if not parallel:
        kernel(*args)
        return
    with _parallel_launch:
        numba.set_num_threads(_threads)
        kernel(*args)


def split_count(requests: int, kv_heads: int) -> int:
    """Key ranges per request and KV head that give each thread JOBS_PER_THREAD jobs."""
    jobs = requests * kv_heads
    return max(1, math.ceil(JOBS_PER_THREAD * _threads / jobs))


@functools.cache
def _kernel(group: int, head_dim: int, block_size: int, parallel: bool):
    """The loops for `group` query heads per KV head of `head_dim`: constants to the compiler,
    so a row's scores and sums stay in registers."""

    @numba.njit(cache=True, fastmath=FAST_MATH, nogil=True, parallel=parallel,
                boundscheck=False)
    def kernel(q, k_pool, v_pool, rows, tables, seq_lens, first_keys, splits, scale, softcap,
               sinks, out):
        kv_heads = k_pool.shape[2]
        per_request = kv_heads * splits
        jobs = rows.shape[0] * per_request
        maxima = np.empty((jobs, group), np.float32)
        totals = np.empty((jobs, group), np.float32)
        sums = np.empty((jobs, group, head_dim), np.float32)
        for job in numba.prange(jobs):
            r, rest = divmod(job, per_request)
            kv_head, part = divmod(rest, splits)
            span = -(-(seq_lens[r] - first_keys[r]) // splits)
            begin = first_keys[r] + part * span
            end = min(seq_lens[r], begin + span)
            q_rows = np.empty((group, head_dim), np.float32)
            for g in range(group):
                for d in range(head_dim):
                    q_rows[g, d] = q[rows[r], kv_head * group + g, d] * scale
            scores = np.empty((max(end - begin, 0), group), np.float32)
            row_max = np.full(group, -np.inf, np.float32)
            for t in range(begin, end):
                key = k_pool[tables[r, t // block_size], t % block_size, kv_head]
                for g in range(group):
                    s = np.float32(0.0)
                    for d in range(head_dim):
                        s += q_rows[g, d] * key[d]
                    if softcap > 0:
                        s = softcap * np.tanh(s / softcap)
                    scores[t - begin, g] = s
                    row_max[g] = max(row_max[g], s)
            total = np.zeros(group, np.float32)
            for i in range(end - begin):
                for g in range(group):
                    weight = np.exp(scores[i, g] - row_max[g])
                    scores[i, g] = weight
                    total[g] += weight
            acc = sums[job]
            acc[:] = 0.0
            for t in range(begin, end):
                value = v_pool[tables[r, t // block_size], t % block_size, kv_head]
                for g in range(group):
                    weight = scores[t - begin, g]
                    for d in range(head_dim):
                        acc[g, d] += weight * value[d]
            maxima[job] = row_max
            totals[job] = total
        # Each head's key ranges, merged at their common maximum (and the head's sink).
        for r in numba.prange(rows.shape[0]):
            for h in range(kv_heads * group):
                kv_head, g = divmod(h, group)
                first = r * per_request + kv_head * splits
                top = -np.inf if sinks.shape[0] == 0 else sinks[h]
                for j in range(first, first + splits):
                    top = max(top, maxima[j, g])
                total = np.float32(0.0) if sinks.shape[0] == 0 else np.exp(sinks[h] - top)
                merged = np.zeros(head_dim, np.float32)
                for j in range(first, first + splits):
                    rescale = np.exp(maxima[j, g] - top) if totals[j, g] > 0 else 0.0
                    total += rescale * totals[j, g]
                    for d in range(head_dim):
                        merged[d] += rescale * sums[j, g, d]
                for d in range(head_dim):
                    out[rows[r], h, d] = merged[d] / total

    return kernel
