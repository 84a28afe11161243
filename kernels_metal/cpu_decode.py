"""Decode attention for MLX's CPU backend: compiled loops that read the paged pools in place.

numpy's path (cpu_attention) gathers each request's blocks into fresh arrays and hands BLAS
one tiny product per request and KV head, each paying microseconds of call and thread
hand-off: 2.4 ms of a one-request decode step of the default model and ~30 ms of a
16-request one. These loops, compiled by numba once per head layout (and cached on disk),
score each decode row against its keys where the pool holds them, take the softmax and sum
the values: one pass over each key and value of a float32 pool.

Large steps (long contexts, many requests) run in parallel; a context too long to share out
by request is cut into key ranges whose partial sums are merged by their softmax maxima, as
flash-decoding does.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numba
import numpy as np

from kernels_metal import cpu_loops, cpu_threads

# Below this many keys x KV heads in a step one thread does the whole step: waking a second
# costs more than it saves.
PARALLEL_FROM = 1 << 15
# Jobs (request x key range) a parallel step is cut into at least, per thread.
JOBS_PER_THREAD = 4


NO_SINKS = np.zeros(0, np.float32)


@dataclass(frozen=True)
class DecodeRows:
    """Rows that each attend to a range of their request's keys: row `rows[r]` to keys
    `first_keys[r]..seq_lens[r] - 1` of block table `tables[r]` (a decode request's one row,
    or a row of a short prefill chunk)."""

    rows: np.ndarray
    tables: np.ndarray
    seq_lens: np.ndarray
    first_keys: np.ndarray

    @functools.cached_property
    def num_keys(self) -> int:
        return int((self.seq_lens - self.first_keys).sum())


def attend(queries: np.ndarray, keys: np.ndarray, values: np.ndarray, decode: DecodeRows,
           scale: float, softcap: float | None, sinks: np.ndarray | None,
           out: np.ndarray) -> None:
    """The `decode` rows of `queries [total_q, H, D]` attend to their keys in the float32
    pools `[blocks, block_size, kv_heads, D]`; their outputs go to the same rows of `out`."""
    _, block_size, kv_heads, head_dim = keys.shape
    parallel = decode.num_keys * kv_heads >= PARALLEL_FROM and cpu_threads.threads() > 1
    splits = split_count(len(decode.rows)) if parallel else 1
    kernel = _kernel(kv_heads, queries.shape[1] // kv_heads, head_dim, block_size, parallel)
    args = (queries, keys, values, decode.rows, decode.tables, decode.seq_lens,
            decode.first_keys, splits, np.float32(scale), np.float32(softcap or 0.0),
            NO_SINKS if sinks is None else sinks, out)
    if parallel:
        cpu_threads.launch(kernel, *args)
    else:
        kernel(*args)


def split_count(requests: int) -> int:
    """Key ranges per request that give each thread JOBS_PER_THREAD jobs."""
    return max(1, math.ceil(JOBS_PER_THREAD * cpu_threads.threads() / requests))


@functools.cache
def _kernel(kv_heads: int, group: int, head_dim: int, block_size: int, parallel: bool):
    """The loops for `kv_heads` KV heads of `group` query heads each, of `head_dim`: constants
    to the compiler, so the inner loops unroll and a row's sums stay in registers.

    A job is one request's key range. It walks its keys in pool order, every head's part of
    a key at once (each key read whole, in the order it lies in memory, which the prefetcher
    follows; a loop per KV head read a quarter of each key per pass and ran several times
    slower once the pool was out of cache).
    """
    heads = kv_heads * group

    @cpu_threads.compile_loop(parallel)
    def kernel(q, k_pool, v_pool, rows, tables, seq_lens, first_keys, splits, scale, softcap,
               sinks, out):
        jobs = rows.shape[0] * splits
        maxima = np.empty((jobs, heads), np.float32)
        totals = np.empty((jobs, heads), np.float32)
        sums = np.empty((jobs, heads, head_dim), np.float32)
        for job in numba.prange(jobs):
            # prange's index is unsigned in a parallel build: unsigned // signed is a float
            r, part = divmod(np.int64(job), splits)
            span = -(-(seq_lens[r] - first_keys[r]) // splits)
            begin = first_keys[r] + part * span
            end = min(seq_lens[r], begin + span)
            q_rows = np.empty((heads, head_dim), np.float32)
            for h in range(heads):
                for d in range(head_dim):
                    q_rows[h, d] = q[rows[r], h, d] * scale
            scores = np.empty((max(end - begin, 0), heads), np.float32)
            row_max = np.full(heads, -np.inf, np.float32)
            for t in range(begin, end):
                key = k_pool[tables[r, t // block_size], t % block_size]
                for h in range(heads):
                    s = np.float32(0.0)
                    for d in range(head_dim):
                        s += q_rows[h, d] * key[h // group, d]
                    if softcap > 0:
                        s = softcap * np.tanh(s / softcap)
                    scores[t - begin, h] = s
                    row_max[h] = max(row_max[h], s)
            for i in range(end - begin):
                for h in range(heads):
                    scores[i, h] -= row_max[h]
            cpu_loops.exp(scores.reshape(-1))  # vectorized; scalar exp cost more than the sums
            total = np.zeros(heads, np.float32)
            for i in range(end - begin):
                for h in range(heads):
                    total[h] += scores[i, h]
            acc = sums[job]
            acc[:] = 0.0
            for t in range(begin, end):
                value = v_pool[tables[r, t // block_size], t % block_size]
                for h in range(heads):
                    weight = scores[t - begin, h]
                    for d in range(head_dim):
                        acc[h, d] += weight * value[h // group, d]
            maxima[job] = row_max
            totals[job] = total
        _merge(maxima, totals, sums, rows, splits, sinks, out)

    return kernel


@numba.njit(cache=True, fastmath=cpu_threads.FAST_MATH, nogil=True, boundscheck=False)
def _merge(maxima, totals, sums, rows, splits, sinks, out):
    """Each head's key ranges, merged at their common maximum (and the head's sink)."""
    heads, head_dim = sums.shape[1], sums.shape[2]
    for r in range(rows.shape[0]):
        first = r * splits
        for h in range(heads):
            top = -np.inf if sinks.shape[0] == 0 else sinks[h]
            for j in range(first, first + splits):
                top = max(top, maxima[j, h])
            total = np.float32(0.0) if sinks.shape[0] == 0 else np.exp(sinks[h] - top)
            merged = np.zeros(head_dim, np.float32)
            for j in range(first, first + splits):
                rescale = np.exp(maxima[j, h] - top) if totals[j, h] > 0 else 0.0
                total += rescale * totals[j, h]
                for d in range(head_dim):
                    merged[d] += rescale * sums[j, h, d]
            for d in range(head_dim):
                out[rows[r], h, d] = merged[d] / total
