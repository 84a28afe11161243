"""The host forward's per-row operations (RMSNorm, rotary embedding, K/V slot writes, exp,
SwiGLU) as compiled loops.

At a decode step of a few requests each of these touches a few kilobytes, so as numpy
expressions their cost was the calls, not the math: an RMSNorm took eight numpy calls and the
rotation of q and k a dozen, ~2 us each, ~4 ms of a one-request step of the default model
(30 layers). One compiled call (numba, cached on disk) does each in one pass over its rows.

exp is a polynomial the compiler vectorizes (relative error below 3e-7): numpy's float32 exp
ran at ~2.6 ns an element on an AVX2 machine, ~10% of a prefill step in SwiGLU and the
softmax; this one runs at ~0.5.

RMSNorm and rope take float32 arrays of any strides (the q/k/v views of one packed product
included); exp and SwiGLU want contiguous rows, so the inner loop is a vector loop. All write
into arrays their callers own.
"""

from __future__ import annotations

import numba
import numpy as np

from kernels_metal.cpu import threads as cpu_threads


@numba.njit(cache=True, fastmath=cpu_threads.FAST_MATH, nogil=True, boundscheck=False)
def rms_norm(x, weight, eps, out):
    """`out = x / sqrt(mean(x^2) + eps) * weight` for rows `x [rows, n]`; `weight [n]`, or
    `[0]` for none; `eps` a Python float."""
    rows, n = x.shape
    scaled = weight.shape[0] != 0
    for r in range(rows):
        total = np.float32(0.0)
        for i in range(n):
            total += x[r, i] * x[r, i]
        inverse = np.float32(1.0 / np.sqrt(total / np.float32(n) + eps))
        if scaled:
            for i in range(n):
                out[r, i] = x[r, i] * inverse * weight[i]
        else:
            for i in range(n):
                out[r, i] = x[r, i] * inverse


@numba.njit(cache=True, fastmath=cpu_threads.FAST_MATH, nogil=True, boundscheck=False)
def rope(x, cos, sin, out):
    """Rotate-half rotary embedding of `x [rows, heads, head_dim]` into `out`: features
    `i` and `i + half` turn by row `r`'s angle `i` (`cos`, `sin`: `[rows, half]`); the
    features from `2 * half` on are copied unturned."""
    rows, heads, head_dim = x.shape
    half = cos.shape[1]
    for r in range(rows):
        for h in range(heads):
            for i in range(half):
                first, second = x[r, h, i], x[r, h, i + half]
                out[r, h, i] = first * cos[r, i] - second * sin[r, i]
                out[r, h, i + half] = second * cos[r, i] + first * sin[r, i]
            for i in range(2 * half, head_dim):
                out[r, h, i] = x[r, h, i]


@numba.njit(cache=True, nogil=True, boundscheck=False)
def write_slots(k_pool, v_pool, slots, k, v):
    """Rows `k[i]`, `v[i]` into slot `slots[i]` (block * block_size + offset) of the float32
    pools `[blocks, block_size, kv_heads, head_dim]`."""
    block_size = k_pool.shape[1]
    for i in range(slots.shape[0]):
        block, offset = slots[i] // block_size, slots[i] % block_size
        k_pool[block, offset] = k[i]
        v_pool[block, offset] = v[i]


# exp(x) = 2^k * exp(f), k = round(x / ln 2), |f| <= ln(2) / 2; exp(f) by Cephes' expf
# polynomial, ln 2 split in two so that k * ln 2 is exact enough.
LOG2E = np.float32(1.4426950408889634)
LN2_HIGH, LN2_LOW = np.float32(0.693359375), np.float32(-2.12194440e-4)
EXP_POLY = tuple(np.float32(c) for c in (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3,
                                         4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1))
# exp's arguments are clamped to this range: results stay normal, finite floats.
EXP_LOW, EXP_HIGH = np.float32(-87.0), np.float32(88.0)


@numba.njit(cache=True, fastmath=cpu_threads.FAST_MATH, nogil=True, boundscheck=False)
def exp(values):
    """`values = exp(max(values, -87))` in place, for a contiguous 1-d float32 array (its
    arguments are at most 88: softmax scores after the shift)."""
    exp_shifted(values, np.float32(0.0), np.empty(values.shape[0], np.int32))


@numba.njit(fastmath=cpu_threads.FAST_MATH, nogil=True, boundscheck=False, inline="always")
def exp_shifted(values, shift, powers):
    """`values = exp(max(values - shift, -87))` in place, for a contiguous 1-d float32 array;
    `powers`: an int32 scratch array at least as long."""
    c0, c1, c2, c3, c4, c5 = EXP_POLY  # locals: the loop vectorizes (a helper call did not)
    n = values.shape[0]
    for i in range(n):
        v = min(max(values[i] - shift, EXP_LOW), EXP_HIGH)
        k = np.floor(v * LOG2E + np.float32(0.5))
        f = v - k * LN2_HIGH - k * LN2_LOW
        p = ((((c0 * f + c1) * f + c2) * f + c3) * f + c4) * f + c5
        powers[i] = (np.int32(k) + 127) << 23  # 2^k as float32 bits
        values[i] = p * f * f + f + np.float32(1.0)
    scale = powers[:n].view(np.float32)
    for i in range(n):
        values[i] *= scale[i]


@numba.njit(cache=True, fastmath=cpu_threads.FAST_MATH, nogil=True, boundscheck=False)
def silu_mul_halves(gate_up, out):
    """SwiGLU of a packed product: `out = silu(gate) * up` for `gate_up [rows, 2 * n]`
    (C-contiguous: gate the first n columns, up the rest) and `out [rows, n]`."""
    rows, n = out.shape
    for r in range(rows):
        row = out[r]
        for i in range(n):
            row[i] = -gate_up[r, i]
        exp(row)
        for i in range(n):
            gate = gate_up[r, i]
            row[i] = gate * gate_up[r, n + i] / (np.float32(1.0) + row[i])


LANES = 16  # partial maxima: a vector register's float32 lanes with AVX-512


@numba.njit(fastmath=cpu_threads.FAST_MATH, nogil=True, boundscheck=False, inline="always")
def largest(values, lanes):
    """The largest of `values` (-inf for none), kept in LANES partial maxima (`lanes`, a
    scratch array) that the compiler turns into one vector maximum per LANES values: as one
    running maximum it did not vectorize and took ~0.8 ns a value, more than the block's two
    products together."""
    n = values.shape[0]
    lanes[:] = -np.inf
    for j in range(0, n - LANES + 1, LANES):
        for lane in range(LANES):
            x = values[j + lane]
            lanes[lane] = x if x > lanes[lane] else lanes[lane]
    top = np.float32(-np.inf)
    for lane in range(LANES):
        top = max(top, lanes[lane])
    for j in range(n - n % LANES, n):
        top = max(top, values[j])
    return top


@numba.njit(fastmath=cpu_threads.FAST_MATH, nogil=True, boundscheck=False, inline="always")
def softmax_weights(row, low, high, softcap, floor, lanes, powers):
    """A row of scores in place into unnormalized softmax weights: `row[low:high]` (after
    `softcap * tanh(s / softcap)` where softcap > 0) to `exp(s - shift)`, every other entry
    to exactly 0, `shift` their maximum or `floor` if larger (a running maximum; -inf for
    none). Returns (shift, the weights' total). `lanes`, `powers`: `largest`'s and
    `exp_shifted`'s scratch arrays. The decode rows and the prefill blocks share it."""
    if softcap > 0:
        for j in range(low, high):
            row[j] = softcap * np.tanh(row[j] / softcap)
    shift = max(floor, largest(row[low:high], lanes))
    exp_shifted(row[low:high], shift, powers)
    total = np.float32(0.0)
    for j in range(low, high):
        total += row[j]
    row[:low] = 0.0
    row[high:] = 0.0
    return shift, total
