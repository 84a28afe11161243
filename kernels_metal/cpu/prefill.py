"""Attention of a prefill chunk for MLX's CPU backend: BLAS products over blocks of keys,
each block's softmax in one compiled call, as flash attention does.

A chunk's query rows of one KV head (rows x group heads) are scored against a block of its
keys in one product, the block's softmax is folded into each row's running maximum, total
and value sum (rescaled when the maximum grows), and the block's weights meet its values in
a second product. With every row of the chunk in one product, BLAS runs near its large-GEMM
rate: on a 2-core AVX-512 Xeon, 768 x 64 against 64 x 512 at ~280 GFLOP/s, where tiles of
14 rows against all 8k keys of a context (what fit a bounded score slice) ran at ~110. The
softmax takes a row at a time from its maximum through exp to its sum while the row is in
L1, where numpy's six passes each went over a slice larger than the L2.

Each thread takes every other block of a KV head (and a share of the heads), with its
products on its own core, and the threads' running sums are merged at the end: one thread
folding between two-thread products left the second core to BLAS's spinning worker. A
layer of 256 rows at an 8k context: ~58 ms in numpy's tiles, 38.8 with the blocks on one
thread, 29.0 shared out.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numba
import numpy as np

from kernels_metal.cpu import loops as cpu_loops
from kernels_metal.cpu import threads as cpu_threads

# Scores of one block product: 2 MB of float32, which stays in a core's L2 between the
# products and the softmax passes.
BLOCK_SCORES = 1 << 19
# Keys of a block, whatever the chunk's rows: fewer made BLAS's calls the cost, more spilled
# a short chunk's blocks out of cache.
MIN_BLOCK_KEYS, MAX_BLOCK_KEYS = 128, 1024


# A KV head's rows folded over some blocks: each row's maximum, total and value sums.
Folded = tuple[np.ndarray, np.ndarray, np.ndarray]


@dataclass(frozen=True)
class Chunk:
    """`count` consecutive rows from packed row `start`, at positions `first_position`
    onwards, over the keys of block table `tables [1, blocks]` up to their last row. Each
    row sees keys up to its position, or up to its `last_keys` entry where there are any
    (an image's tokens seeing each other: kernels_metal.metadata)."""

    start: int
    count: int
    first_position: int
    tables: np.ndarray
    last_keys: np.ndarray | None = None

    @property
    def num_keys(self) -> int:
        return self.first_position + self.count

    @cached_property
    def row_last_keys(self) -> np.ndarray:
        """`[count]` int64: the last key each row sees (non-decreasing)."""
        if self.last_keys is None:
            return np.arange(self.first_position, self.num_keys, dtype=np.int64)
        return np.minimum(self.last_keys, self.num_keys - 1).astype(np.int64)


def attend(queries: np.ndarray, keys: np.ndarray, values: np.ndarray, chunk: Chunk,
           scale: float, window: int | None, softcap: float | None,
           sinks: np.ndarray | None, out: np.ndarray) -> None:
    """The chunk's rows of `queries [total_q, H, D]` over its keys `[num_keys, kv_heads, D]`
    and values `[num_keys, kv_heads, Dv]` (float32, causal, within `window` if set), into its
    rows of `out [total_q, H, Dv]`."""
    rows, kv_heads = chunk.count, keys.shape[1]
    heads, head_dim = queries.shape[1], queries.shape[2]
    group = heads // kv_heads
    chunk_rows = slice(chunk.start, chunk.start + rows)
    # A KV head's query rows, row-major: (row, head of the group) -> row * group + head.
    by_kv_head = queries[chunk_rows].reshape(rows, kv_heads, group, head_dim)
    scaled = [by_kv_head[:, kv].reshape(rows * group, head_dim) * np.float32(scale)
              for kv in range(kv_heads)]
    block = _block_keys(rows * group)
    first_key = 0 if window is None else max(0, chunk.first_position - window + 1)
    begins = range(first_key, chunk.num_keys, block)
    shares = max(1, min(cpu_threads.threads(), len(begins)))

    def fold(job: tuple[int, int]) -> Folded:
        kv, share = job
        return _fold_blocks(scaled[kv], keys[:, kv], values[:, kv], begins[share::shares],
                            block, chunk, group, window, softcap)

    jobs = [(kv, share) for kv in range(kv_heads) for share in range(shares)]
    # KV heads share out too: a chunk of one block folded head after head on one thread
    # left BLAS's own spinning workers the cores (512 rows of 20 heads: 533 ms, 60 shared).
    folded = cpu_threads.map_on_threads(fold, jobs) if len(jobs) > 1 else list(map(fold, jobs))
    for kv in range(kv_heads):
        row_max, totals, sums = _merged(folded[kv * shares:(kv + 1) * shares])
        if sinks is not None:
            _add_sinks(sinks[kv * group:(kv + 1) * group], row_max, totals, sums)
        sums /= totals[:, None]
        out[chunk_rows, kv * group:(kv + 1) * group] = sums.reshape(rows, group, -1)


def _fold_blocks(q: np.ndarray, keys: np.ndarray, values: np.ndarray, begins: range,
                 block: int, chunk: Chunk, group: int, window: int | None,
                 softcap: float | None) -> Folded:
    """Scaled query rows `q [rows * group, D]` of one KV head folded over the blocks of
    `keys [num_keys, D]`, `values [num_keys, Dv]` that start at `begins`."""
    rows = chunk.count
    row_max = np.full(rows * group, -np.inf, np.float32)
    totals = np.zeros(rows * group, np.float32)
    sums = np.zeros((rows * group, values.shape[1]), np.float32)
    for begin in begins:
        end = min(begin + block, chunk.num_keys)
        # The rows that see any of these keys: from the first whose last key is at or past
        # `begin`, up to the last whose window reaches back to `end - 1`.
        first = int(np.searchsorted(chunk.row_last_keys, begin))
        last = rows if window is None else min(rows, end - 1 + window - chunk.first_position)
        if first >= last:
            continue
        seen = slice(first * group, last * group)
        scores = q[seen] @ keys[begin:end].T
        fold_block(scores, chunk.first_position + first, chunk.row_last_keys[first:last], group,
                   begin, window or 0, np.float32(softcap or 0.0), row_max[seen], totals[seen],
                   sums[seen])
        sums[seen] += scores @ values[begin:end]
    return row_max, totals, sums


def _merged(parts: list[Folded]) -> Folded:
    """The threads' folds of the same rows as one, at each row's largest maximum."""
    if len(parts) == 1:
        return parts[0]
    top = np.maximum.reduce([row_max for row_max, _, _ in parts])
    totals = np.zeros_like(parts[0][1])
    sums = np.zeros_like(parts[0][2])
    for row_max, part_totals, part_sums in parts:
        rescale = np.exp(row_max - top)  # 0 for a part that saw none of a row's keys
        totals += rescale * part_totals
        sums += rescale[:, None] * part_sums
    return top, totals, sums


def _block_keys(score_rows: int) -> int:
    """Keys of a block whose product with `score_rows` query rows holds ~BLOCK_SCORES."""
    keys = BLOCK_SCORES // max(score_rows, 1)
    return min(MAX_BLOCK_KEYS, max(MIN_BLOCK_KEYS, keys // 64 * 64))


def _add_sinks(sinks: np.ndarray, row_max: np.ndarray, totals: np.ndarray,
               sums: np.ndarray) -> None:
    """Each row's head sink logit (a key with no value) into its total, at a maximum that
    includes it."""
    group = len(sinks)
    row_sinks = np.tile(sinks, len(totals) // group)
    top = np.maximum(row_max, row_sinks)
    rescale = np.exp(row_max - top)
    totals *= rescale
    totals += np.exp(row_sinks - top)
    sums *= rescale[:, None]


@numba.njit(cache=True, fastmath=cpu_threads.FAST_MATH, nogil=True, boundscheck=False)
def fold_block(scores, first_position, last_keys, group, first_key, window, softcap, row_max,
               totals, sums):
    """One block's scores `[rows * group, keys]` (keys from `first_key`) in place into
    softmax weights at each row's new running maximum; the row's `totals` and value `sums`
    rescaled to that maximum, its block weights added to `totals`. A row at position p
    weighs keys up to its `last_keys` entry (p, or past p inside an image), and from
    p - window + 1 with a `window`; the rest get exactly 0.

    A row at a time, so that it stays in L1 from its first read to its last write."""
    count, keys = scores.shape
    lanes = np.empty(cpu_loops.LANES, np.float32)
    powers = np.empty(keys, np.int32)
    for i in range(count):
        position = first_position + i // group
        high = min(keys, last_keys[i // group] - first_key + 1)
        low = 0 if window == 0 else min(high, max(0, position - window + 1 - first_key))
        top, total = cpu_loops.softmax_weights(scores[i], low, high, softcap, row_max[i],
                                               lanes, powers)
        rescale = np.exp(row_max[i] - top) if row_max[i] > -np.inf else np.float32(0.0)
        if rescale != 1:
            totals[i] *= rescale
            for d in range(sums.shape[1]):
                sums[i, d] *= rescale
        row_max[i] = top
        totals[i] += total
