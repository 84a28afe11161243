"""Products of one or a few rows with a weight matrix (`rows @ weight.T`) in compiled loops.

A decode step of a few requests multiplies a few rows by every weight matrix. BLAS's GEMM
packs the weight into panels first, a copy as large as the product's own reads, and at 16
rows it ran at half its large-GEMM rate. These loops (numba, compiled once and cached on disk)
read each weight row once from where it lies and multiply it with every input row in tiles
of 2 or 4 input x 4 weight rows kept in registers: at 16 rows on the default model's
matrices, 72 GFLOP/s on two AVX2 cores where BLAS ran at 54, 166 on two Zen 5 cores where
BLAS ran at 99.

Two to four rows (a decode step of a few requests, one request's token and its drafts) read
each weight row once with every input row's sum in a register: as fast as one row where the
tiles ran ~1.5x slower (the default model's products of a step: 1 row 13.7 ms; 2 rows 20.7 in
tiles, 13.4 so; 4 rows 20.0 in tiles, 15.6 so; at 8 rows the tiles win again).

One row (a one-request decode step) is a matrix-vector product that only streams the weight.
OpenBLAS runs those below ~500k weights (the default model's attention projections) on one
thread, at half the memory's rate, and its workers spinning between calls kept the compiled
loops' workers (other products, attention) off the second core. Every one-row product here on
the same thread pool as the rest: the default model's products of one step 26 -> 23 ms.
"""

from __future__ import annotations

import platform

import numba
import numpy as np
from llvmlite import binding as llvm

from kernels_metal.cpu import threads as cpu_threads


def _vector_registers() -> int:
    """Vector registers the compiled loops get: 32 with AVX-512 or on Arm, else 16."""
    if platform.machine().lower() in ("arm64", "aarch64"):
        return 32
    chosen = numba.config.CPU_FEATURES  # a target the user set for numba
    if chosen:
        return 32 if "+avx512f" in chosen.split(",") else 16
    return 32 if llvm.get_host_cpu_features().get("avx512f") else 16


# A register tile: input rows x 4 weight rows, its sums and the input vectors held in
# registers. With 16 (AVX2), 2 x 4: 4 x 4 spilled and ran 1.3x slower at 16 rows. With 32,
# 4 x 4: on a Zen 5 ~10% faster than 2 x 4 at 16-48 rows and 1.2x at 256.
INPUT_TILE, WEIGHT_TILE = (4 if _vector_registers() == 32 else 2), 4


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
                if INPUT_TILE == 4:  # a constant: the compiler keeps one of the two
                    _tile_4x4(x, m, w0, w1, w2, w3, out, n)
                else:
                    _tile_2x4(x, m, w0, w1, w2, w3, out, n)
        # Weight rows past the last whole tile, one at a time.
        for n in range(columns - columns % WEIGHT_TILE, columns):
            for m in range(rows):
                s = np.float32(0.0)
                for k in range(inner):
                    s += x[m, k] * w[n, k]
                out[m, n] = s

    return tiles


# Sums in tuples, not arrays: numba keeps a tuple's scalars in registers (the compiler turns
# each into a vector of partial sums over k), never a small array's.
@numba.njit(fastmath=cpu_threads.FAST_MATH, nogil=True, boundscheck=False, inline="always")
def _add_products(u, v, sums):
    """`sums + u * v` for one input row's value `u` and 4 weight rows' values `v` at one k."""
    return sums[0] + u * v[0], sums[1] + u * v[1], sums[2] + u * v[2], sums[3] + u * v[3]


@numba.njit(fastmath=cpu_threads.FAST_MATH, nogil=True, boundscheck=False, inline="always")
def _store(out, m, n, sums):
    out[m, n], out[m, n + 1], out[m, n + 2], out[m, n + 3] = sums


@numba.njit(fastmath=cpu_threads.FAST_MATH, nogil=True, boundscheck=False, inline="always")
def _tile_2x4(x, m, w0, w1, w2, w3, out, n):
    x0, x1 = x[m], x[m + 1]
    zero = np.float32(0.0)
    s0 = s1 = (zero, zero, zero, zero)
    for k in range(x.shape[1]):
        v = w0[k], w1[k], w2[k], w3[k]
        s0 = _add_products(x0[k], v, s0)
        s1 = _add_products(x1[k], v, s1)
    _store(out, m, n, s0)
    _store(out, m + 1, n, s1)


@numba.njit(fastmath=cpu_threads.FAST_MATH, nogil=True, boundscheck=False, inline="always")
def _tile_4x4(x, m, w0, w1, w2, w3, out, n):
    x0, x1, x2, x3 = x[m], x[m + 1], x[m + 2], x[m + 3]
    zero = np.float32(0.0)
    s0 = s1 = s2 = s3 = (zero, zero, zero, zero)
    for k in range(x.shape[1]):
        v = w0[k], w1[k], w2[k], w3[k]
        s0 = _add_products(x0[k], v, s0)
        s1 = _add_products(x1[k], v, s1)
        s2 = _add_products(x2[k], v, s2)
        s3 = _add_products(x3[k], v, s3)
    _store(out, m, n, s0)
    _store(out, m + 1, n, s1)
    _store(out, m + 2, n, s2)
    _store(out, m + 3, n, s3)


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

NARROW_ROWS = 4  # up to this many rows a product reads one weight row at a time (`_narrow`:
# its 2- and 4-row forms, 3 padded to 4; not a knob)


def _narrow_of(parallel: bool):
    @cpu_threads.compile_loop(parallel)
    def narrow(w, x, out):
        # One weight row at a time, as the matrix-vector product, with two or four input
        # rows' sums beside each other (`x`: 2 or 4 rows, a third padded by a zero row).
        columns, inner = w.shape
        zero = np.float32(0.0)
        if x.shape[0] == 2:
            x0, x1 = x[0], x[1]
            for n in numba.prange(columns):
                row = w[n]
                s0 = s1 = zero
                for k in range(inner):
                    v = row[k]
                    s0 += v * x0[k]
                    s1 += v * x1[k]
                out[0, n], out[1, n] = s0, s1
            return
        x0, x1, x2, x3 = x[0], x[1], x[2], x[3]
        for n in numba.prange(columns):
            row = w[n]
            s0 = s1 = s2 = s3 = zero
            for k in range(inner):
                v = row[k]
                s0 += v * x0[k]
                s1 += v * x1[k]
                s2 += v * x2[k]
                s3 += v * x3[k]
            out[0, n], out[1, n], out[2, n], out[3, n] = s0, s1, s2, s3

    return narrow


_narrow = _narrow_of(parallel=False)
_parallel_narrow = _narrow_of(parallel=True)


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
    """`out [m, out] = x @ w.T` for C-contiguous float32 `x [m, in]` and `w [out, in]`: one
    row as a matrix-vector product, up to NARROW_ROWS one weight row at a time (3 rows padded
    to 4), more in register tiles (whole tiles, padded with zero rows); on the loops'
    parallel builds or one-thread ones (`cpu_threads.run`)."""
    rows = x.shape[0]
    if rows == 1:
        if parallel:
            _parallel_matvec(w, x[0], out[0])
        else:
            _matvec(w, x[0], out[0])
        return
    narrow = rows <= NARROW_ROWS
    whole = (4 if rows == 3 else rows) if narrow else -(-rows // INPUT_TILE) * INPUT_TILE
    padded_x, padded_out = _padded(x, out, whole)
    if narrow and parallel:
        _parallel_narrow(w, padded_x, padded_out)
    elif narrow:
        _narrow(w, padded_x, padded_out)
    elif parallel:
        _parallel_tiles(padded_x, w, padded_out)
    else:
        _tiles(padded_x, w, padded_out)
    if whole != rows:
        out[:] = padded_out[:rows]
