"""Decode attention for MLX's CPU backend: compiled loops that read the paged pools in place.

numpy's path (cpu_attention) gathers each request's blocks into fresh arrays and hands BLAS
one tiny product per request and KV head, each paying microseconds of call and thread
hand-off: 2.4 ms of a one-request decode step of the default model and ~30 ms of a
16-request one. These loops, compiled by numba once (and cached on disk), score a request's
rows (its decode row, or its rows verifying drafts) against its keys where the pool holds
them, take the softmax and sum the values: one pass over each key and value of a float32
pool for all the request's rows. Compiled callers (cpu_layer) call them as well.

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
from kernels_metal.cpu.register_tiles import key_dots, prefetch, weighted_rows

# Below this many keys x KV heads in a step one thread does the whole step: waking a second
# costs more than it saves (on a 2-core Zen 5, two threads won from ~1200: 16 requests at
# 200 keys 0.32 -> 0.18 ms a layer, one at 8k keys 1.48 -> 0.78).
PARALLEL_FROM = 1 << 11
# Jobs (request x key range) a parallel step is cut into at least, per thread, and the
# fewest keys a range is cut down to: a job scores all its request's rows, so a short
# range of many rows cost more to set up and merge than it shared out (8 rows at 200 keys
# in 8 ranges: 2.7 ms the 30 layers, against 2.0 in one job a row).
JOBS_PER_THREAD = 4
SPLIT_KEYS = 128


NO_SINKS = np.zeros(0, np.float32)


@dataclass(frozen=True)
class DecodeRows:
    """Rows that each attend to a range of their request's keys: row `rows[r]` to keys
    `first_keys[r]..seq_lens[r] - 1` of block table `tables[r]` (a decode request's one row
    or its rows with drafts, or a row of a short prefill chunk). A request's rows are
    consecutive: request i's are `requests[i]..requests[i + 1] - 1`."""

    rows: np.ndarray
    requests: np.ndarray
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
        if not parallel:
            return 1, False
        longest = int((self.seq_lens - self.first_keys).max())
        return min(split_count(len(self.requests) - 1), -(-longest // SPLIT_KEYS)), True


def attend(queries: np.ndarray, keys: np.ndarray, values: np.ndarray, decode: DecodeRows,
           scale: float, softcap: float | None, sinks: np.ndarray | None,
           out: np.ndarray) -> None:
    """The `decode` rows of `queries [total_q, H, D]` attend to their keys in the float32
    pools `[blocks, block_size, kv_heads, D]`; their outputs go to the same rows of `out`."""
    splits, parallel = decode.split(keys.shape[2])
    cpu_threads.run(attend_rows, queries, keys, values, decode.rows, decode.requests,
                    decode.tables, decode.seq_lens, decode.first_keys, splits, np.float32(scale),
                    np.float32(softcap or 0.0), NO_SINKS if sinks is None else sinks, out,
                    parallel=parallel)


def split_count(requests: int) -> int:
    """Key ranges per request that give each thread JOBS_PER_THREAD jobs."""
    return max(1, math.ceil(JOBS_PER_THREAD * cpu_threads.threads() / requests))


@numba.njit(cache=True, fastmath=cpu_threads.FAST_MATH, nogil=True, boundscheck=False)
def attend_rows(q, k_pool, v_pool, rows, requests, tables, seq_lens, first_keys, splits, scale,
                softcap, sinks, out, parallel):
    """`attend` for compiled callers (cpu_layer): the loops' parallel build or one-thread one."""
    if parallel:
        _parallel_rows(q, k_pool, v_pool, rows, requests, tables, seq_lens, first_keys, splits,
                       scale, softcap, sinks, out)
    else:
        _rows(q, k_pool, v_pool, rows, requests, tables, seq_lens, first_keys, splits, scale,
              softcap, sinks, out)


def _rows_of(parallel: bool):
    @cpu_threads.compile_loop(parallel)
    def rows_kernel(q, k_pool, v_pool, rows, requests, tables, seq_lens, first_keys, splits,
                    scale, softcap, sinks, out):
        heads, head_dim = q.shape[1], q.shape[2]
        group = heads // k_pool.shape[2]
        jobs = (requests.shape[0] - 1) * splits
        maxima = np.empty((rows.shape[0] * splits, heads), np.float32)
        totals = np.empty((rows.shape[0] * splits, heads), np.float32)
        sums = np.empty((rows.shape[0] * splits, heads, head_dim), np.float32)
        for job in numba.prange(jobs):
            # prange's index is unsigned in a parallel build: unsigned // signed is a float
            request, part = divmod(np.int64(job), splits)
            first_row, end_row = requests[request], requests[request + 1]
            low = first_keys[first_row:end_row].min()
            high = seq_lens[first_row:end_row].max()
            span = -(-(high - low) // splits)
            begin = low + part * span
            _key_range(q[rows[first_row:end_row]] * scale, k_pool, v_pool, tables[first_row],
                       begin, min(high, begin + span), first_keys[first_row:end_row],
                       seq_lens[first_row:end_row], softcap, group, head_dim, maxima, totals,
                       sums, first_row, part, splits)
        _merge(maxima, totals, sums, rows, splits, sinks, out)

    return rows_kernel


@numba.njit(fastmath=cpu_threads.FAST_MATH, nogil=True, boundscheck=False, inline="always")
def _key_range(q_rows, k_pool, v_pool, table, begin, end, first_keys, seq_lens, softcap, group,
               head_dim, maxima, totals, sums, first_row, part, splits):
    """One job: one request's scaled query rows `q_rows [R, H, D]` over keys `begin..end -
    1` of block table `table`, row i weighing those from `first_keys[i]` to `seq_lens[i] -
    1`: each row's and head's maximum, exp sum and weighted value sums, at index
    `(first_row + i) * splits + part` of `maxima`, `totals` and `sums`.

    Each block of keys (then of values) is read once for all the request's rows (a step
    verifying drafts read them once a row), and whole before the next (a loop per KV head
    over all the keys read a quarter of each key per pass and ran several times slower once
    the pool was out of cache). A head's scores of a block's keys come a vector of keys at a
    time (`_dots`); each row's and head's scores then go through their softmax while in L1;
    the values a KV head at a time, its group's sums in registers (`_add_values`), each block
    asking the cache for the next.
    """
    num_rows, heads = q_rows.shape[0], q_rows.shape[1]
    block_size, kv_heads = k_pool.shape[1], k_pool.shape[2]
    count_all = max(end - begin, 0)
    scores = np.empty((num_rows, heads, count_all), np.float32)
    t = begin
    while t < end:
        block, first = k_pool[table[t // block_size]], t % block_size
        count = min(block_size - first, end - t)
        if t + count < end:  # a head's reads below take a third of each key, strided
            prefetch(k_pool[table[(t + count) // block_size]])
        for i in range(num_rows):
            for h in range(heads):
                _dots(q_rows[i], h, block, first, count, h // group, scores[i], t - begin,
                      head_dim)
        t += count
    lanes = np.empty(cpu_loops.LANES, np.float32)
    powers = np.empty(count_all, np.int32)
    for i in range(num_rows):
        at = (first_row + i) * splits + part
        low = min(max(first_keys[i] - begin, 0), count_all)
        high = max(min(seq_lens[i] - begin, count_all), low)
        for h in range(heads):
            maxima[at, h], totals[at, h] = cpu_loops.softmax_weights(
                scores[i, h], low, high, softcap, np.float32(-np.inf), lanes, powers)
        sums[at] = 0.0
    t = begin
    while t < end:
        block, first = v_pool[table[t // block_size]], t % block_size
        count = min(block_size - first, end - t)
        if t + count < end:  # the group's reads below skip the other heads' parts of a key
            prefetch(v_pool[table[(t + count) // block_size]])
        for kv in range(kv_heads):
            values = block[first:first + count, kv]
            for i in range(num_rows):
                _add_values(scores[i].T[t - begin:t - begin + count], values,
                            sums[(first_row + i) * splits + part], kv * group, group)
        t += count


# A head's dot products with a vector of keys at a time, for the common head sizes (the
# others in a loop of a runtime size, ~1.3x slower than one the compiler knows).
_dots_64, _dots_128, _dots_256 = (key_dots(d) for d in (64, 128, 256))


@numba.njit(fastmath=cpu_threads.FAST_MATH, nogil=True, boundscheck=False, inline="always")
def _dots(q, h, block, first, count, kv, scores, column, head_dim):
    """`scores[h, column + j] = q[h] @ block[first + j, kv]` for j < count."""
    if head_dim == 64:
        _dots_64(q, h, block, first, count, kv, scores, column)
    elif head_dim == 128:
        _dots_128(q, h, block, first, count, kv, scores, column)
    elif head_dim == 256:
        _dots_256(q, h, block, first, count, kv, scores, column)
    else:
        for j in range(count):
            s = np.float32(0.0)
            for d in range(head_dim):
                s += q[h, d] * block[first + j, kv, d]
            scores[h, column + j] = s


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
