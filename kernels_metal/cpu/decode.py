"""Decode attention for MLX's CPU backend: compiled loops that read the paged pools in place.

numpy's path (cpu_attention) gathers each request's blocks into fresh arrays and hands BLAS
one tiny product per request and KV head, each paying microseconds of call and thread
hand-off: 2.4 ms of a one-request decode step of the default model and ~30 ms of a
16-request one. These loops, compiled by numba once (and cached on disk), score each decode
row against its keys where the pool holds them, take the softmax and sum the values: one pass
over each key and value of a float32 pool. Compiled callers (cpu_layer) call them as well.

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

from kernels_metal.cpu import loops as cpu_loops
from kernels_metal.cpu import threads as cpu_threads
from kernels_metal.cpu.register_tiles import prefetch, weighted_rows

# Below this many keys x KV heads in a step one thread does the whole step: waking a second
# costs more than it saves (on a 2-core Zen 5, two threads won from ~1200: 16 requests at
# 200 keys 0.32 -> 0.18 ms a layer, one at 8k keys 1.48 -> 0.78).
PARALLEL_FROM = 1 << 11
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

    def split(self, kv_heads: int) -> tuple[int, bool]:
        """(key ranges per request, whether the threads share the jobs) for pools of
        `kv_heads` KV heads."""
        parallel = self.num_keys * kv_heads >= PARALLEL_FROM and cpu_threads.threads() > 1
        return (split_count(len(self.rows)) if parallel else 1), parallel


def attend(queries: np.ndarray, keys: np.ndarray, values: np.ndarray, decode: DecodeRows,
           scale: float, softcap: float | None, sinks: np.ndarray | None,
           out: np.ndarray) -> None:
    """The `decode` rows of `queries [total_q, H, D]` attend to their keys in the float32
    pools `[blocks, block_size, kv_heads, D]`; their outputs go to the same rows of `out`."""
    splits, parallel = decode.split(keys.shape[2])
    cpu_threads.run(attend_rows, queries, keys, values, decode.rows, decode.tables,
                    decode.seq_lens, decode.first_keys, splits, np.float32(scale),
                    np.float32(softcap or 0.0), NO_SINKS if sinks is None else sinks, out,
                    parallel=parallel)


def split_count(requests: int) -> int:
    """Key ranges per request that give each thread JOBS_PER_THREAD jobs."""
    return max(1, math.ceil(JOBS_PER_THREAD * cpu_threads.threads() / requests))


@numba.njit(cache=True, fastmath=cpu_threads.FAST_MATH, nogil=True, boundscheck=False)
def attend_rows(q, k_pool, v_pool, rows, tables, seq_lens, first_keys, splits, scale, softcap,
                sinks, out, parallel):
    """`attend` for compiled callers (cpu_layer): the loops' parallel build or one-thread one."""
    if parallel:
        _parallel_rows(q, k_pool, v_pool, rows, tables, seq_lens, first_keys, splits, scale,
                       softcap, sinks, out)
    else:
        _rows(q, k_pool, v_pool, rows, tables, seq_lens, first_keys, splits, scale, softcap,
              sinks, out)


def _rows_of(parallel: bool):
    @cpu_threads.compile_loop(parallel)
    def rows_kernel(q, k_pool, v_pool, rows, tables, seq_lens, first_keys, splits, scale,
                    softcap, sinks, out):
        heads, head_dim = q.shape[1], q.shape[2]
        group = heads // k_pool.shape[2]
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
            q_rows = q[rows[r]] * scale
            # A head size the compiler knows unrolls the dot products and keeps a row's sums
            # in registers: a runtime one ran ~1.3x slower.
            if head_dim == 64:
                _key_range(q_rows, k_pool, v_pool, tables[r], begin, end, softcap, group, 64,
                           maxima[job], totals[job], sums[job])
            elif head_dim == 128:
                _key_range(q_rows, k_pool, v_pool, tables[r], begin, end, softcap, group, 128,
                           maxima[job], totals[job], sums[job])
            else:
                _key_range(q_rows, k_pool, v_pool, tables[r], begin, end, softcap, group,
                           head_dim, maxima[job], totals[job], sums[job])
        _merge(maxima, totals, sums, rows, splits, sinks, out)

    return rows_kernel


@numba.njit(fastmath=cpu_threads.FAST_MATH, nogil=True, boundscheck=False, inline="always")
def _key_range(q_rows, k_pool, v_pool, table, begin, end, softcap, group, head_dim, row_max,
               total, acc):
    """One job: scaled query heads `q_rows [H, D]` over keys `begin..end - 1` of block table
    `table`: the heads' running maxima, exp sums and weighted value sums.

    It walks its keys in pool order, block by block, every head's part of a key at once (each
    key read whole, in the order it lies in memory, which the prefetcher follows; a loop per
    KV head read a quarter of each key per pass and ran several times slower once the pool
    was out of cache). The values go a KV head at a time, its group's sums in registers
    (`_add_values`), each block asking the cache for the next: 8 rows at 1200 keys, 30
    layers, 14.2-15.7 -> 10.9-11.4 ms; one row 2.8-3.0 -> 2.7-2.8.
    """
    heads = q_rows.shape[0]
    block_size, kv_heads = k_pool.shape[1], k_pool.shape[2]
    scores = np.empty((max(end - begin, 0), heads), np.float32)
    row_max[:] = -np.inf
    t = begin
    while t < end:
        block, first = k_pool[table[t // block_size]], t % block_size
        count = min(block_size - first, end - t)
        for j in range(count):
            key = block[first + j]
            for kv in range(kv_heads):
                for g in range(group):
                    h = kv * group + g
                    s = np.float32(0.0)
                    for d in range(head_dim):
                        s += q_rows[h, d] * key[kv, d]
                    if softcap > 0:
                        s = softcap * np.tanh(s / softcap)
                    scores[t - begin + j, h] = s
                    row_max[h] = max(row_max[h], s)
        t += count
    for i in range(end - begin):
        for h in range(heads):
            scores[i, h] -= row_max[h]
    cpu_loops.exp(scores.reshape(-1))  # vectorized; scalar exp cost more than the sums
    total[:] = 0.0
    for i in range(end - begin):
        for h in range(heads):
            total[h] += scores[i, h]
    acc[:] = 0.0
    t = begin
    while t < end:
        block, first = v_pool[table[t // block_size]], t % block_size
        count = min(block_size - first, end - t)
        weights = scores[t - begin:t - begin + count]
        if t + count < end:  # the group's reads below skip the other heads' parts of a key
            prefetch(v_pool[table[(t + count) // block_size]])
        for kv in range(kv_heads):
            _add_values(weights, block[first:first + count, kv], acc, kv * group, group)
        t += count


# A GQA group's value sums in registers, up to 4 heads at once (register_tiles).
_values_1, _values_2, _values_3, _values_4 = (weighted_rows(h) for h in (1, 2, 3, 4))


@numba.njit(fastmath=cpu_threads.FAST_MATH, nogil=True, boundscheck=False, inline="always")
def _add_values(weights, values, acc, first, heads):
    """`acc[h] += weights[:, h] @ values` for heads `first..first + heads - 1`: each value
    read once for the group (a loop's `acc[h] += w * value` ran ~3x slower, storing and
    reloading the sums every key)."""
    h = first
    while first + heads - h >= 4:
        _values_4(weights, h, values, acc, h)
        h += 4
    left = first + heads - h
    if left == 3:
        _values_3(weights, h, values, acc, h)
    elif left == 2:
        _values_2(weights, h, values, acc, h)
    elif left == 1:
        _values_1(weights, h, values, acc, h)


_rows = _rows_of(parallel=False)
_parallel_rows = _rows_of(parallel=True)


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
