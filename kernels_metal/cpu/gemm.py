"""Products of rows with a weight matrix (`rows @ weight.T`) in compiled loops.

A decode step of a few requests multiplies a few rows by every weight matrix. BLAS's GEMM
packs the weight into panels first, a copy as large as the product's own reads, and at 16
rows it ran at half its large-GEMM rate; OpenBLAS ran one-row products below ~500k weights
on one thread, at half the memory's rate, and its workers spinning between calls kept the
compiled loops' workers off the second core. Here every product runs on the compiled loops'
own thread pool and reads each weight row from memory once, in register tiles (cpu
register_tiles: input rows x weight rows, every sum in a vector register) that prefetch the
weight rows further on while they multiply.

The tile is chosen by the product's rows, for as few reads per multiply as the registers
allow. The default model's layer products on two Zen 4 cores (32 vector registers), against
the numba loops these replaced (one weight row at a time up to 4 rows, 4 x 4 tiles past):
1 row 14.1 ms, as before (1 x 4); 4 rows 19.6 -> 13.6 (4 x 6); 8 rows 24.4 -> 15.3 (8 x 2);
16 rows 33.2 -> 24.0 and 48 rows 67.1 -> 56.3 (4 x 6). With 16 registers (AVX2) every tile
is 2 x 4, whose sums and reads fit them.

They serve every float32 product of a step, however many rows: on the same cores they ran
as fast as OpenBLAS from 1 row to 1024 (256 rows 275 ms against 330, 1024 1186 against 1147),
and with no BLAS in a step nothing spins beside the compiled loops (a step verifying 4.5
drafts for each of 16 requests, 72 rows: 418 ms with its products in BLAS, 146 in tiles).
"""

from __future__ import annotations

import numba
import numpy as np

from kernels_metal.cpu import threads as cpu_threads
from kernels_metal.cpu.register_tiles import VECTOR_REGISTERS, register_tile

# (input rows, weight rows) of each tile, and the tiles with one weight row that finish
# the weight rows past the last whole tile.
TILE_SHAPES = ((1, 4), (2, 4), (4, 6), (8, 2))
_1x4, _2x4, _4x6, _8x2 = (register_tile(*shape) for shape in TILE_SHAPES)
_1x1, _2x1, _4x1, _8x1 = (register_tile(rows, 1) for rows, _ in TILE_SHAPES)
# The rows past the last whole 2 x 4 or 4 x 6 tile, one at a time in the same sweep over a
# block of weight rows (a zero-padded tile cost a whole tile's multiplies: 16 requests and
# one draft, 17 rows, as many as 20). A product of fewer rows than its tile (3 rows, 5-7)
# pads them: a tile reads the weights at memory speed, three 1 x 6 passes did not keep up
# (3 rows 18.5 ms against 4 rows' 11.1).
_1x6 = register_tile(1, 6)

# Weight rows ahead of the tile that the tile prefetches (4-16 ran alike; the memory then
# serves the next tiles' reads while this one multiplies).
PREFETCH_AHEAD = 8


@numba.njit(inline="always")
def tile_for(rows: int) -> int:
    """The index in TILE_SHAPES of the tile for a product of `rows` rows."""
    if rows == 1:
        return 0
    if rows == 2 or VECTOR_REGISTERS < 32:
        return 1
    return 3 if 4 < rows <= 8 else 2


def linear(rows: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """`rows @ weight.T` for float32 `rows [m, in]` and `weight [out, in]`."""
    out = np.empty((len(rows), weight.shape[0]), np.float32)
    if weight.strides[1] != weight.itemsize:  # a transposed view: the tiles read rows whole
        weight = np.ascontiguousarray(weight)
    cpu_threads.run(product, np.ascontiguousarray(rows), weight, out)
    return out


@numba.njit(fastmath=cpu_threads.FAST_MATH, nogil=True, boundscheck=False, inline="always")
def _tile(shape, x, w, out, m, n, ahead):
    if shape == 0:
        _1x4(x, w, out, m, n, ahead)
    elif shape == 1:
        _2x4(x, w, out, m, n, ahead)
    elif shape == 2:
        _4x6(x, w, out, m, n, ahead)
    else:
        _8x2(x, w, out, m, n, ahead)


@numba.njit(fastmath=cpu_threads.FAST_MATH, nogil=True, boundscheck=False, inline="always")
def _one_column(shape, x, w, out, m, n):
    if shape == 0:
        _1x1(x, w, out, m, n, -1)
    elif shape == 1:
        _2x1(x, w, out, m, n, -1)
    elif shape == 2:
        _4x1(x, w, out, m, n, -1)
    else:
        _8x1(x, w, out, m, n, -1)


@numba.njit(fastmath=cpu_threads.FAST_MATH, nogil=True, boundscheck=False, inline="always")
def _one_row(shape, x, w, out, m, n):
    """Row `m` alone against the weight rows of a tile of `shape` (2 x 4 or 4 x 6)."""
    if shape == 1:
        _1x4(x, w, out, m, n, -1)
    else:
        _1x6(x, w, out, m, n, -1)


def _tiles_of(parallel: bool):
    @cpu_threads.compile_loop(parallel)
    def tiles(x, w, out, shape, tail):
        """The tiles of `shape` over `x`'s rows, the last `tail` (fewer than a tile's) one
        at a time."""
        input_rows, weight_rows = TILE_SHAPES[shape]
        whole = x.shape[0] - tail
        columns = w.shape[0]
        blocks = columns // weight_rows
        for block in numba.prange(blocks):
            n = block * weight_rows
            ahead = n + PREFETCH_AHEAD
            if ahead + weight_rows > columns:
                ahead = -1
            for m in range(0, whole, input_rows):
                _tile(shape, x, w, out, m, n, ahead if m == 0 else -1)
            for m in range(whole, whole + tail):
                _one_row(shape, x, w, out, m, n)
        for n in range(blocks * weight_rows, columns):
            for m in range(0, whole, input_rows):
                _one_column(shape, x, w, out, m, n)
            for m in range(whole, whole + tail):
                _1x1(x, w, out, m, n, -1)

    return tiles


_tiles = _tiles_of(parallel=False)
_parallel_tiles = _tiles_of(parallel=True)


@numba.njit(fastmath=cpu_threads.FAST_MATH, nogil=True, boundscheck=False, inline="always")
def _padded(x, out, rows):
    """`x` and `out` with `rows` rows: themselves, or zero-padded copies of `x` and a scratch
    `out` where `rows` is more than they have."""
    if x.shape[0] == rows:
        return x, out
    padded = np.zeros((rows, x.shape[1]), np.float32)
    padded[: x.shape[0]] = x
    return padded, np.empty((rows, out.shape[1]), np.float32)


@numba.njit(cache=True, fastmath=cpu_threads.FAST_MATH, nogil=True, boundscheck=False)
def product(x, w, out, parallel):
    """`out [m, out] = x @ w.T` for float32 `x [m, in]` and `w [out, in]` whose rows are
    contiguous, in the tiles `tile_for` picks (the rows past the last whole tile one at a
    time, or fewer rows than a tile padded to one), on the loops' parallel builds or
    one-thread ones (`cpu_threads.run`)."""
    rows = x.shape[0]
    shape = tile_for(rows)
    tile_rows = TILE_SHAPES[shape][0]
    tail = 0 if rows < tile_rows else rows % tile_rows
    padded_x, padded_out = _padded(x, out, max(rows, tile_rows))
    if parallel:
        _parallel_tiles(padded_x, w, padded_out, shape, tail)
    else:
        _tiles(padded_x, w, padded_out, shape, tail)
    if padded_out.shape[0] != rows:
        out[:] = padded_out[:rows]
