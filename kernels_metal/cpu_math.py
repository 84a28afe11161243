"""exp, softmax and SwiGLU with a fast path for MLX's CPU backend.

The CPU backend computes transcendental functions one scalar at a time (~18 ns an element),
which made SiLU and the attention softmax cost as much as the matmuls around them. Here
exp(x) = 2^n * exp(r) with r = x - n ln2 (Cody-Waite: ln2 split in two so r stays exact) and
exp(r) a degree-7 Taylor polynomial on |r| <= ln2/2, built from arithmetic that `mx.compile`
fuses into one loop: ~4x faster, relative error ~1e-7. Other devices use MLX's own ops.
"""

from __future__ import annotations

import math

import mlx.core as mx
from mlx import nn

LOG2_E = 1.4426950408889634
LN2_HI, LN2_LO = 0.693359375, -2.12194440e-4  # LN2_HI has few mantissa bits: n * LN2_HI is exact
TAYLOR = tuple(1.0 / math.factorial(k) for k in range(7, -1, -1))  # highest degree first


def _exp_parts(x: mx.array) -> tuple[mx.array, mx.array]:
    """exp(r) and the float32 bit pattern of 2^n, with x = n ln2 + r."""
    x = mx.clip(x, -87.0, 88.0)
    n = mx.floor(x * LOG2_E + 0.5)
    r = x - n * LN2_HI - n * LN2_LO
    p = TAYLOR[0]
    for c in TAYLOR[1:]:
        p = p * r + c
    return p, (n.astype(mx.int32) + 127) << 23


_exp_parts_compiled = mx.compile(_exp_parts, shapeless=True)
_silu_mul_compiled = mx.compile(lambda g, u, e: g * u / (1 + e), shapeless=True)


def on_cpu() -> bool:
    return mx.default_device() == mx.cpu


def exp(x: mx.array) -> mx.array:
    if not on_cpu():
        return mx.exp(x)
    p, bits = _exp_parts_compiled(x)
    return p * bits.view(mx.float32)  # a bit-cast cannot be traced shapeless: kept outside


def softmax(x: mx.array, axis: int = -1) -> mx.array:
    if not on_cpu():
        return mx.softmax(x, axis=axis, precise=True)
    e = exp(x - mx.max(x, axis=axis, keepdims=True))
    return e / mx.sum(e, axis=axis, keepdims=True)


def silu_mul(gate: mx.array, up: mx.array) -> mx.array:
    """SwiGLU's `silu(gate) * up`."""
    if not on_cpu():
        return nn.silu(gate) * up
    return _silu_mul_compiled(gate, up, exp(-gate))
