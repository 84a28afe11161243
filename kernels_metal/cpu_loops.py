"""The host forward's small per-row operations (RMSNorm, rotary embedding) as compiled loops.

At a decode step of a few requests each of these touches a few kilobytes, so as numpy
expressions their cost was the calls, not the math: an RMSNorm took eight numpy calls and the
rotation of q and k a dozen, ~2 us each, ~4 ms of a one-request step of the default model
(30 layers). One compiled call (numba, cached on disk) does each in one pass over its rows.

They take float32 arrays of any strides (the q/k/v views of one packed product included) and
write into `out` arrays their callers own.
"""

from __future__ import annotations

import numba
import numpy as np

from kernels_metal import cpu_threads


@numba.njit(cache=True, fastmath=cpu_threads.FAST_MATH, nogil=True, boundscheck=False)
def rms_norm(x, weight, eps, out):
    """`out = x / sqrt(mean(x^2) + eps) * weight` for rows `x [rows, n]`; `weight [n]`, or
    `[0]` for none."""
    rows, n = x.shape
    scaled = weight.shape[0] != 0
    for r in range(rows):
        total = np.float32(0.0)
        for i in range(n):
            total += x[r, i] * x[r, i]
        inverse = np.float32(1.0) / np.sqrt(total / np.float32(n) + eps)
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
