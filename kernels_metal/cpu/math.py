"""exp, softmax, gated activations, soft-capping and linear layers with a fast path for MLX's
CPU backend.

The CPU backend computes transcendental functions one scalar at a time (~16 ns an element,
compiled or not), which made SiLU, tanh and the attention softmax cost more than the matmuls
around them. Off Metal these hand the (already evaluated) array to numpy's vectorized math
(~0.6 ns an element) and back; other devices use MLX's own ops. Each also takes numpy
arrays, the CPU backend's host forward (kernels_metal/cpu/host_forward.py), and returns numpy then.

Products go to numpy's BLAS over zero-copy views of the weights (float32 ones of 1 to 63
rows to cpu_gemm's compiled loops), not through MLX, for two reasons. A one-row product
(batch-1 decode) is memory-bound, and the CPU backend sends it through the general matmul,
which streams weights at about half the rate of a matrix-vector kernel. And numpy's wheel
bundles its own OpenBLAS beside the one MLX binds to: OpenBLAS workers spin for a while after
each call, so two libraries taking turns (numpy in the attention, MLX in the projections)
fight over the same cores; one BLAS for every product avoids that (a batch-8 decode step ran
2x slower with both).
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
from mlx import nn

from kernels_metal.cpu import gemm as cpu_gemm
from kernels_metal.cpu import loops as cpu_loops

# exp below this is a float32 denormal: flushed to 0, since denormals slow every later op.
DENORMAL_EXP_BOUND = float(cpu_loops.EXP_LOW)
SQRT_2_OVER_PI = math.sqrt(2 / math.pi)
# Below this many rows BLAS takes a transposed (or row-strided) right operand several times
# slower than a left one: such products put the big operand on the left (the decode scores
# in cpu_attention) or go to cpu_gemm's tiles (`host_linear` here).
FEW_ROWS = 32
NO_WEIGHT = np.zeros(0, np.float32)  # cpu_loops.rms_norm's "no weight"


def on_cpu() -> bool:
    return mx.default_device() == mx.cpu


def array_module(x: mx.array | np.ndarray):
    """`np` for a host array, `mx` for an MLX one: the ops both spell the same way."""
    return np if isinstance(x, np.ndarray) else mx


def _host(x: mx.array | np.ndarray) -> np.ndarray:
    """A float32 copy of `x` on the host, to work on in place."""
    if isinstance(x, np.ndarray):
        return x.astype(np.float32)
    # Reading the buffer evaluates x; on the CPU backend evaluation is synchronous anyway.
    return np.array(x.astype(mx.float32))


def _like(values: np.ndarray, x: mx.array | np.ndarray) -> mx.array | np.ndarray:
    """`values` as the kind and dtype of array `x` is."""
    if isinstance(x, np.ndarray):
        return values.astype(x.dtype, copy=False)
    return mx.array(values).astype(x.dtype)


def _exp_in_place(values: np.ndarray) -> np.ndarray:
    tiny = values < DENORMAL_EXP_BOUND
    with np.errstate(over="ignore"):
        np.exp(values, out=values)
    np.copyto(values, 0.0, where=tiny)
    return values


def exp(x: mx.array) -> mx.array:
    if not on_cpu():
        return mx.exp(x)
    return _like(_exp_in_place(_host(x)), x)


def masked_softmax(x: mx.array, mask: mx.array, axis: int = -1) -> mx.array:
    """Softmax over `axis` of `x` where `mask` (broadcastable bool) is True; 0 elsewhere."""
    if not on_cpu():
        return mx.softmax(mx.where(mask, x, -mx.inf), axis=axis, precise=True)
    values = _host(x)
    np.copyto(values, -np.inf, where=~np.asarray(mask))
    return _like(_softmax_in_place(values, axis), x)


def softmax(x: mx.array, axis: int = -1) -> mx.array:
    if not on_cpu():
        return mx.softmax(x, axis=axis, precise=True)
    return _like(_softmax_in_place(_host(x), axis), x)


def _softmax_in_place(values: np.ndarray, axis: int) -> np.ndarray:
    values -= values.max(axis=axis, keepdims=True)
    probs = _exp_in_place(values)
    probs /= probs.sum(axis=axis, keepdims=True)
    return probs


def linear(x: mx.array, weight: mx.array, bias: mx.array | None = None) -> mx.array:
    """`x @ weight.T + bias` for `x [rows, in]` and `weight [out, in]`."""
    if isinstance(x, np.ndarray):
        return host_linear(x, np.asarray(weight), _host_or_none(bias))
    if not (on_cpu() and x.dtype == weight.dtype == mx.float32):
        if bias is None:
            return x @ weight.T
        return mx.addmm(bias, x, weight.T)
    return mx.array(host_linear(np.asarray(x), np.asarray(weight), _host_or_none(bias)))


def _host_or_none(x: mx.array | np.ndarray | None) -> np.ndarray | None:
    return None if x is None else np.asarray(x)


def host_linear(rows: np.ndarray, weight: np.ndarray,
                bias: np.ndarray | None = None) -> np.ndarray:
    """`rows @ weight.T + bias`: float32 rows in cpu_gemm's compiled loops, others in numpy's
    BLAS."""
    if rows.dtype == weight.dtype == np.float32:
        y = cpu_gemm.linear(rows, weight)
    elif len(rows) == 1:
        # BLAS streams the weight about twice as fast as the left operand of a matrix-vector
        # product as it does as the transposed right operand of a one-row product.
        y = (weight @ rows[0])[None]
    else:
        y = rows @ weight.T
    return y if bias is None else np.add(y, bias, out=y)


def silu_mul(gate: mx.array, up: mx.array) -> mx.array:
    """SwiGLU's `silu(gate) * up`."""
    if isinstance(gate, np.ndarray):
        # 1 + e^-gate, built in place; e^88 is near float32's largest, so none overflows
        denominator = np.minimum(np.negative(gate), np.float32(88.0))
        np.exp(denominator, out=denominator)
        denominator += 1
        out = np.multiply(gate, up)
        return np.divide(out, denominator, out=out)
    if not on_cpu():
        return nn.silu(gate) * up
    return gate * up / (1 + exp(-gate))


def silu_mul_halves(gate_up: np.ndarray) -> np.ndarray:
    """`silu_mul` of the two halves of a packed float32 product `[rows, 2 * inner]` (gate,
    then up) on the host, in one compiled pass over its rows."""
    out = np.empty((gate_up.shape[0], gate_up.shape[1] // 2), np.float32)
    cpu_loops.silu_mul_halves(np.ascontiguousarray(gate_up, np.float32), out)
    return out


def gelu_tanh_mul(gate: mx.array, up: mx.array) -> mx.array:
    """GeGLU's `gelu_tanh(gate) * up` (transformers' `gelu_pytorch_tanh`, as in Gemma)."""
    if not on_cpu():
        return nn.gelu_approx(gate) * up
    g = _host(gate)
    activated = 0.5 * g * (1 + np.tanh(SQRT_2_OVER_PI * (g + 0.044715 * g**3)))
    return _like(activated, gate) * up


def tanh_softcap(x: mx.array, cap: float) -> mx.array:
    """`cap * tanh(x / cap)`: squashes x smoothly into (-cap, cap)."""
    if not on_cpu():
        return mx.tanh(x / cap) * cap
    return _like(np.tanh(_host(x) / cap) * cap, x)


def rms_norm(x: mx.array | np.ndarray, weight: mx.array | np.ndarray | None,
             eps: float) -> mx.array | np.ndarray:
    """`x / sqrt(mean(x^2) + eps) * weight` over the last axis (no weight: 1)."""
    if not isinstance(x, np.ndarray):
        return mx.fast.rms_norm(x, weight, eps)
    if x.dtype == np.float32:
        rows = x if x.ndim == 2 else x.reshape(-1, x.shape[-1])
        out = np.empty(rows.shape, np.float32)
        scale = NO_WEIGHT if weight is None else np.asarray(weight, np.float32)
        cpu_loops.rms_norm(rows, scale, eps, out)
        return out if x.ndim == 2 else out.reshape(x.shape)
    mean_square = np.einsum("...i,...i->...", x, x)[..., None] / np.float32(x.shape[-1])
    scale = 1 / np.sqrt(mean_square + np.float32(eps))
    return x * (scale if weight is None else scale * np.asarray(weight))
