"""Products of one or a few rows with a weight matrix (`rows @ weight.T`) in compiled loops.

A decode step of a few requests multiplies a few rows by every weight matrix. BLAS's GEMM
packs the weight into panels first, a copy as large as the product's own reads, and at 16
rows it ran at half its large-GEMM rate. These loops (numba, compiled once and cached on disk)
read each weight row once from where it lies and multiply it with every input row in tiles
of 2 input x 4 weight rows kept in registers: 72 GFLOP/s on the default model's matrices at
16 rows on two AVX2 cores, where BLAS ran at 54.

One row (a one-request decode step) is a matrix-vector product that only streams the weight.
OpenBLAS runs those below ~500k weights (the default model's attention projections) on one
thread, at half the memory's rate, and its workers spinning between calls kept the compiled
loops' workers (other products, attention) off the second core. Every one-row product here on
the same thread pool as the rest: the default model's products of one step 26 -> 23 ms.
"""

from __future__ import annotations

import numba
import numpy as np

from kernels_metal import cpu_threads

# A register tile: 2 input rows x 4 weight rows. Its 8 sums and the 2 input vectors fit the
# 16 AVX registers; 4 x 4 spilled and ran 1.3x slower at 16 rows.
INPUT_TILE, WEIGHT_TILE = 2, 4


def few_rows(rows: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """`rows @ weight.T` for float32 `rows [m, in]` and `weight [out, in]`."""
    out = np.empty((len(rows), weight.shape[0]), np.float32)
    cpu_threads.run(product, np.ascontiguousarray(rows), weight, out)
    return out


def _tiles_of(parallel: bool):
    @cpu_threads.compile_loop(parallel)
    def tiles(x, w, out):
        rows, inner = x.shape
        columns = w.shape[0]
        for block in numba.prange(columns // WEIGHT_TILE):
            n = block * WEIGHT_TILE
            w0, w1, w2, w3 = w[n], w[n + 1], w[n + 2], w[n + 3]
            for m in range(0, rows, INPUT_TILE):
                x0, x1 = x[m], x[m + 1]
                a00 = a01 = a02 = a03 = np.float32(0.0)
                a10 = a11 = a12 = a13 = np.float32(0.0)
                # Spelled out: numba keeps scalars in registers (the compiler turns each into a
                # vector of partial sums over k), never a small array.
                for k in range(inner):
                    v0, v1, v2, v3 = w0[k], w1[k], w2[k], w3[k]
                    u = x0[k]
                    a00 += u * v0
                    a01 += u * v1
                    a02 += u * v2
                    a03 += u * v3
                    u = x1[k]
                    a10 += u * v0
                    a11 += u * v1
                    a12 += u * v2
                    a13 += u * v3
                out[m, n], out[m, n + 1], out[m, n + 2], out[m, n + 3] = a00, a01, a02, a03
                out[m + 1, n], out[m + 1, n + 1] = a10, a11
                out[m + 1, n + 2], out[m + 1, n + 3] = a12, a13
        # Weight rows past the last whole tile, one at a time.
        for n in range(columns - columns % WEIGHT_TILE, columns):
            for m in range(rows):
                s = np.float32(0.0)
                for k in range(inner):
                    s += x[m, k] * w[n, k]
                out[m, n] = s

    return tiles


_tiles = _tiles_of(parallel=False)
_parallel_tiles = _tiles_of(parallel=True)


def _matvec_of(parallel: bool):
    @cpu_threads.compile_loop(parallel)
    def matvec(w, x, out):
        # One weight row at a time: fewer streams a thread than a tile of rows, and it read
        # the default model's weights ~10% faster than tiles of 2 or 4.
        columns, inner = w.shape
        for n in numba.prange(columns):
            row = w[n]
            s = np.float32(0.0)
            for k in range(inner):
                s += row[k] * x[k]
            out[n] = s

    return matvec


_matvec = _matvec_of(parallel=False)
_parallel_matvec = _matvec_of(parallel=True)


@numba.njit(cache=True, fastmath=cpu_threads.FAST_MATH, nogil=True, boundscheck=False)
def product(x, w, out, parallel):
    """`out [m, out] = x @ w.T` for C-contiguous float32 `x [m, in]` and `w [out, in]`: one
    row as a matrix-vector product, more in register tiles (whole tiles, padded with zero
    rows); on the loops' parallel builds or one-thread ones (`cpu_threads.run`)."""
    rows = x.shape[0]
    if rows == 1:
        if parallel:
            _parallel_matvec(w, x[0], out[0])
        else:
            _matvec(w, x[0], out[0])
        return
    tiled, full = x, out
    if rows % INPUT_TILE:
        tiled = np.zeros((rows + INPUT_TILE - rows % INPUT_TILE, x.shape[1]), np.float32)
        tiled[:rows] = x
        full = np.empty((tiled.shape[0], w.shape[0]), np.float32)
    if parallel:
        _parallel_tiles(tiled, w, full)
    else:
        _tiles(tiled, w, full)
    if rows % INPUT_TILE:
        out[:] = full[:rows]
