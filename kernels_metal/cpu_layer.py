"""A pre-norm decoder layer's step of a few host rows, around its attention, in two compiled
calls.

Between its weight products a layer of a one-request decode step does a dozen small things
(two RMSNorms, rope of q and k, biases, SwiGLU, two residual sums), each reached through its
modules' Python: ~130 us a layer beside the products, ~4 ms of the default model's ~30-ms
step. `attention_inputs` does everything before the attention (norm, q/k/v product, q/k
norms, rope) in one call, `after_attention` everything after it (o product, residual, norm,
gate/up product, SwiGLU, down product, residual) in another; the attention between them is
the layer's own. The loops are the ones the module-by-module path calls (cpu_loops,
cpu_gemm), in the same order, so the numbers are the same.
"""

from __future__ import annotations

import numba
import numpy as np

from kernels_metal import cpu_gemm, cpu_loops, cpu_threads

NONE = np.zeros(0, np.float32)  # no bias, no q/k norm


def attention_inputs(x: np.ndarray, norm: tuple[np.ndarray, float],
                     qkv: tuple[np.ndarray, np.ndarray | None],
                     qk_norms: tuple[np.ndarray, np.ndarray, float] | None,
                     rope: tuple[np.ndarray, np.ndarray],
                     shape: tuple[int, int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q, k, v `[rows, heads, head_dim]` of float32 rows `x [rows, hidden]`: `norm` (weight,
    eps) of x times the packed q/k/v `qkv` (weight, bias); q and k normed per head by
    `qk_norms` (q weight, k weight, eps) when given, then turned by `rope` (cos, sin
    `[rows, half]`). `shape`: heads, KV heads, head_dim."""
    q_norm, k_norm, qk_eps = (NONE, NONE, 0.0) if qk_norms is None else qk_norms
    cos, sin = rope
    return cpu_threads.run(_attention_inputs, np.ascontiguousarray(x), *norm, qkv[0],
                           _or_none(qkv[1]), q_norm, k_norm, qk_eps, cos, sin, *shape)


def after_attention(x: np.ndarray, attended: np.ndarray,
                    o: tuple[np.ndarray, np.ndarray | None], norm: tuple[np.ndarray, float],
                    gate_up: tuple[np.ndarray, np.ndarray | None],
                    down: tuple[np.ndarray, np.ndarray | None]) -> np.ndarray:
    """The layer's output rows: `h = x + o(attended)`, then `h + down(silu(gate) * up)` of
    `norm(h)`, with the gate and up halves of one packed product. Each product is
    (weight, bias)."""
    return cpu_threads.run(_after_attention, np.ascontiguousarray(x), attended, o[0],
                           _or_none(o[1]), *norm, gate_up[0], _or_none(gate_up[1]), down[0],
                           _or_none(down[1]))


def _or_none(bias: np.ndarray | None) -> np.ndarray:
    return NONE if bias is None else bias


@numba.njit(cache=True, fastmath=cpu_threads.FAST_MATH, nogil=True, boundscheck=False)
def _attention_inputs(x, norm, eps, qkv_weight, qkv_bias, q_norm, k_norm, qk_eps, cos, sin,
                      heads, kv_heads, head_dim, parallel):
    rows = x.shape[0]
    normed = np.empty(x.shape, np.float32)
    cpu_loops.rms_norm(x, norm, eps, normed)
    qkv = np.empty((rows, qkv_weight.shape[0]), np.float32)
    cpu_gemm.product(normed, qkv_weight, qkv, parallel)
    if qkv_bias.shape[0]:
        qkv += qkv_bias
    q_end, k_end = heads * head_dim, (heads + kv_heads) * head_dim
    q = np.ascontiguousarray(qkv[:, :q_end]).reshape(rows, heads, head_dim)
    k = np.ascontiguousarray(qkv[:, q_end:k_end]).reshape(rows, kv_heads, head_dim)
    v = np.ascontiguousarray(qkv[:, k_end:]).reshape(rows, kv_heads, head_dim)
    if q_norm.shape[0]:  # in place: each row's sum is taken before it is written
        q_heads, k_heads = q.reshape(-1, head_dim), k.reshape(-1, head_dim)
        cpu_loops.rms_norm(q_heads, q_norm, qk_eps, q_heads)
        cpu_loops.rms_norm(k_heads, k_norm, qk_eps, k_heads)
    q_turned, k_turned = np.empty(q.shape, np.float32), np.empty(k.shape, np.float32)
    cpu_loops.rope(q, cos, sin, q_turned)
    cpu_loops.rope(k, cos, sin, k_turned)
    return q_turned, k_turned, v


@numba.njit(cache=True, fastmath=cpu_threads.FAST_MATH, nogil=True, boundscheck=False)
def _after_attention(x, attended, o_weight, o_bias, norm, eps, gate_up_weight, gate_up_bias,
                     down_weight, down_bias, parallel):
    rows, hidden = x.shape
    h = np.empty((rows, hidden), np.float32)
    cpu_gemm.product(attended, o_weight, h, parallel)
    if o_bias.shape[0]:
        h += o_bias
    h += x
    normed = np.empty((rows, hidden), np.float32)
    cpu_loops.rms_norm(h, norm, eps, normed)
    gate_up = np.empty((rows, gate_up_weight.shape[0]), np.float32)
    cpu_gemm.product(normed, gate_up_weight, gate_up, parallel)
    if gate_up_bias.shape[0]:
        gate_up += gate_up_bias
    activated = np.empty((rows, gate_up.shape[1] // 2), np.float32)
    cpu_loops.silu_mul_halves(gate_up, activated)
    out = np.empty((rows, hidden), np.float32)
    cpu_gemm.product(activated, down_weight, out, parallel)
    if down_bias.shape[0]:
        out += down_bias
    out += h
    return out
