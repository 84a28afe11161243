"""Pre-norm decoder layers' steps of a few host rows in compiled calls: a run of layers in
one call, or one layer in two around its attention.

Between its weight products a layer of a one-request decode step does a dozen small things
(two RMSNorms, rope of q and k, biases, SwiGLU, two residual sums, the K/V write and the
attention), each reached through Python: ~130 us a layer beside the products when each went
through its module, still ~100 us in two calls around the attention (~3 ms of the default
model's ~27-ms step). `step_layers` runs every layer of a `LayerStack` in one call when the
step's attention is all cpu_decode's rows; otherwise `attention_inputs` does what comes before
a layer's attention (norm, q/k/v product, q/k norms, rope) and `after_attention` what comes
after (o product, residual, norm, gate/up product, SwiGLU, down product, residual). The loops
are the ones the module-by-module path calls (cpu_loops, cpu_gemm, cpu_decode), in the same
order, so the numbers are the same. Where LoRA adapters are loaded, each targeted product
adds its adapter rows' deltas (cpu_low_rank) before anything reads it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numba
import numpy as np
from numba.typed import List

from kernels_metal.cpu import decode as cpu_decode
from kernels_metal.cpu import gemm as cpu_gemm
from kernels_metal.cpu import loops as cpu_loops
from kernels_metal.cpu import low_rank as cpu_low_rank
from kernels_metal.cpu import threads as cpu_threads

NONE = np.zeros(0, np.float32)  # no bias, no q/k norm
# The projections an adapter may target, attention's then the MLP's: `LayerArrays.lora`.
ATTENTION_LORA = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_LORA = ("gate_proj", "up_proj", "down_proj")
NUM_LORA_TARGETS = len(ATTENTION_LORA) + len(MLP_LORA)


@dataclass(frozen=True)
class LayerArrays:
    """What a layer's compiled step takes besides its rows: its parameters as float32 numpy
    arrays (weight, bias or eps; a bias or q/k norm that is absent is None) and its
    attention's head shape and options."""

    input_norm: tuple[np.ndarray, float]
    qkv: tuple[np.ndarray, np.ndarray | None]  # q, k and v packed, in that order
    qk_norms: tuple[np.ndarray, np.ndarray, float] | None  # q weight, k weight, eps
    shape: tuple[int, int, int]  # heads, KV heads, head_dim
    o: tuple[np.ndarray, np.ndarray | None]
    post_norm: tuple[np.ndarray, float]
    gate_up: tuple[np.ndarray, np.ndarray | None]  # gate and up packed, in that order
    down: tuple[np.ndarray, np.ndarray | None]
    attention: tuple[float, float | None, int | None, bool]  # scale, softcap, window, sinks
    # The loaded adapters' stacks of each of ATTENTION_LORA and MLP_LORA, in that order
    # (cpu_low_rank.host_pair's; NO_PAIRs where none targets it).
    lora: tuple[tuple[np.ndarray, np.ndarray], ...]

    def qk_norm_arrays(self) -> tuple[np.ndarray, np.ndarray, float]:
        """q weight, k weight, eps as the compiled step takes them (empty: no q/k norms)."""
        return self.qk_norms or (NONE, NONE, 0.0)


def attention_inputs(x: np.ndarray, arrays: LayerArrays,
                     rope: tuple[np.ndarray, np.ndarray], lora_rows: cpu_low_rank.HostRows
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q, k, v `[rows, heads, head_dim]` of float32 rows `x [rows, hidden]`: the input norm
    of x times the packed q/k/v (plus the adapter deltas of `lora_rows`, as
    cpu_low_rank.host_rows gives them); q and k normed per head when the layer has q/k
    norms, then turned by `rope` (cos, sin `[rows, half]`)."""
    return cpu_threads.run(_attention_inputs, np.ascontiguousarray(x), *arrays.input_norm,
                           arrays.qkv[0], _or_none(arrays.qkv[1]), *arrays.qk_norm_arrays(),
                           *rope, *arrays.shape, *arrays.lora[:3], lora_rows)


def after_attention(x: np.ndarray, attended: np.ndarray, arrays: LayerArrays,
                    lora_rows: cpu_low_rank.HostRows) -> np.ndarray:
    """The layer's output rows: `h = x + o(attended)`, then `h + down(silu(gate) * up)` of
    the post-attention norm of h (each product plus the adapter deltas of `lora_rows`)."""
    return cpu_threads.run(_after_attention, np.ascontiguousarray(x), attended, arrays.o[0],
                           _or_none(arrays.o[1]), *arrays.post_norm, arrays.gate_up[0],
                           _or_none(arrays.gate_up[1]), arrays.down[0],
                           _or_none(arrays.down[1]), *arrays.lora[3:], lora_rows)


class LayerStack:
    """Consecutive layers' arrays as numba typed lists, one per kind in layer order: what
    `step_layers` takes. Building one costs milliseconds: it is made once and kept while its
    arrays are."""

    def __init__(self, layers: Sequence[LayerArrays]) -> None:
        self.shape = layers[0].shape
        self.input_norms = listed(a.input_norm[0] for a in layers)
        self.input_eps = np.array([a.input_norm[1] for a in layers])
        self.qkv = listed(a.qkv[0] for a in layers)
        self.qkv_biases = listed(_or_none(a.qkv[1]) for a in layers)
        self.q_norms = listed(a.qk_norm_arrays()[0] for a in layers)
        self.k_norms = listed(a.qk_norm_arrays()[1] for a in layers)
        self.qk_eps = np.array([a.qk_norm_arrays()[2] for a in layers])
        self.o = listed(a.o[0] for a in layers)
        self.o_biases = listed(_or_none(a.o[1]) for a in layers)
        self.post_norms = listed(a.post_norm[0] for a in layers)
        self.post_eps = np.array([a.post_norm[1] for a in layers])
        self.gate_up = listed(a.gate_up[0] for a in layers)
        self.gate_up_biases = listed(_or_none(a.gate_up[1]) for a in layers)
        self.down = listed(a.down[0] for a in layers)
        self.down_biases = listed(_or_none(a.down[1]) for a in layers)
        # Layer i's t-th pair of `LayerArrays.lora` at i * NUM_LORA_TARGETS + t.
        self.lora_a = listed(a for layer in layers for a, _ in layer.lora)
        self.lora_b = listed(b for layer in layers for _, b in layer.lora)

    @staticmethod
    def takes(layers: Sequence[LayerArrays]) -> bool:
        """Whether these layers can share one: one head shape, every array C-contiguous (a
        list holds arrays of one layout)."""
        arrays = []
        for a in layers:
            arrays += [a.input_norm[0], *a.qkv, *a.qk_norm_arrays()[:2], *a.o,
                       a.post_norm[0], *a.gate_up, *a.down, *(m for pair in a.lora for m in pair)]
        return (all(a.shape == layers[0].shape for a in layers)
                and all(a is None or a.flags.c_contiguous for a in arrays))


def pool_lists(k_pools: Sequence[np.ndarray], v_pools: Sequence[np.ndarray]) -> tuple:
    """The layers' float32 K and V pools (numpy views) as the typed lists `step_layers`
    takes."""
    return listed(k_pools), listed(v_pools)


def step_layers(x: np.ndarray, stack: LayerStack, pools: tuple,
                rope: tuple[np.ndarray, np.ndarray], slots: np.ndarray,
                decode: cpu_decode.DecodeRows, scale: float, softcap: float | None,
                lora_rows: cpu_low_rank.HostRows) -> np.ndarray:
    """Float32 rows `x [rows, hidden]` through every layer of `stack`: each writes the rows'
    k and v into slots `slots` of its pools (`pool_lists`), then its q rows attend as
    cpu_decode's `decode` rows (which must be all of them). `rope`: cos, sin `[rows, half]`,
    the same for every layer; `lora_rows`: the adapter rows (cpu_low_rank.host_rows)."""
    splits, attend_parallel = decode.split(stack.shape[1])
    s = stack
    return cpu_threads.run(
        _layers, np.ascontiguousarray(x), s.input_norms, s.input_eps, s.qkv, s.qkv_biases,
        s.q_norms, s.k_norms, s.qk_eps, *rope, *s.shape, *pools, slots,
        decode.rows, decode.requests, decode.tables, decode.seq_lens, decode.first_keys, splits,
        attend_parallel, np.float32(scale), np.float32(softcap or 0.0), s.o, s.o_biases,
        s.post_norms, s.post_eps, s.gate_up, s.gate_up_biases, s.down, s.down_biases,
        s.lora_a, s.lora_b, lora_rows)


def _or_none(bias: np.ndarray | None) -> np.ndarray:
    return NONE if bias is None else bias


def listed(arrays) -> object:
    """Arrays (at least one) of one dtype, rank and layout as a numba typed list."""
    first, *rest = arrays
    out = _list_of(first)
    for array in rest:
        _append(out, array)
    return out


# The list is built by cached calls: `List(arrays)` compiles the list's methods in every
# process (~0.2-0.5 s a kind of array, ~1 s of each server start); these load from disk, and
# are compiled once per kind of array (a call over a whole tuple would be once per length).
@numba.njit(cache=True, nogil=True)
def _list_of(first):
    out = List()
    out.append(first)
    return out


@numba.njit(cache=True, nogil=True)
def _append(out, array):
    out.append(array)


@numba.njit(cache=True, fastmath=cpu_threads.FAST_MATH, nogil=True, boundscheck=False)
def _layers(x, input_norms, input_eps, qkv, qkv_biases, q_norms, k_norms, qk_eps, cos, sin,
            heads, kv_heads, head_dim, k_pools, v_pools, slots, rows, requests, tables, seq_lens,
            first_keys, splits, attend_parallel, scale, softcap, o, o_biases, post_norms,
            post_eps, gate_up, gate_up_biases, down, down_biases, lora_a, lora_b, lora_rows,
            parallel):
    for i in range(len(qkv)):
        t = i * NUM_LORA_TARGETS
        q, k, v = _attention_inputs(x, input_norms[i], input_eps[i], qkv[i], qkv_biases[i],
                                    q_norms[i], k_norms[i], qk_eps[i], cos, sin, heads,
                                    kv_heads, head_dim, (lora_a[t], lora_b[t]),
                                    (lora_a[t + 1], lora_b[t + 1]),
                                    (lora_a[t + 2], lora_b[t + 2]), lora_rows, parallel)
        cpu_loops.write_slots(k_pools[i], v_pools[i], slots, k, v)
        attended = np.empty(q.shape, np.float32)
        cpu_decode.attend_rows(q, k_pools[i], v_pools[i], rows, requests, tables, seq_lens,
                               first_keys, splits, scale, softcap, cpu_decode.NO_SINKS, attended,
                               attend_parallel and parallel)
        x = _after_attention(x, attended.reshape(x.shape[0], -1), o[i], o_biases[i],
                             post_norms[i], post_eps[i], gate_up[i], gate_up_biases[i],
                             down[i], down_biases[i], (lora_a[t + 3], lora_b[t + 3]),
                             (lora_a[t + 4], lora_b[t + 4]), (lora_a[t + 5], lora_b[t + 5]),
                             (lora_a[t + 6], lora_b[t + 6]), lora_rows, parallel)
    return x


@numba.njit(cache=True, fastmath=cpu_threads.FAST_MATH, nogil=True, boundscheck=False)
def _attention_inputs(x, norm, eps, qkv_weight, qkv_bias, q_norm, k_norm, qk_eps, cos, sin,
                      heads, kv_heads, head_dim, q_lora, k_lora, v_lora, lora_rows, parallel):
    rows = x.shape[0]
    normed = np.empty(x.shape, np.float32)
    cpu_loops.rms_norm(x, norm, eps, normed)
    qkv = np.empty((rows, qkv_weight.shape[0]), np.float32)
    cpu_gemm.product(normed, qkv_weight, qkv, parallel)
    if qkv_bias.shape[0]:
        qkv += qkv_bias
    q_end, k_end = heads * head_dim, (heads + kv_heads) * head_dim
    cpu_low_rank.add(normed, qkv[:, :q_end], q_lora, lora_rows, parallel)
    cpu_low_rank.add(normed, qkv[:, q_end:k_end], k_lora, lora_rows, parallel)
    cpu_low_rank.add(normed, qkv[:, k_end:], v_lora, lora_rows, parallel)
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
                     down_weight, down_bias, o_lora, gate_lora, up_lora, down_lora, lora_rows,
                     parallel):
    rows, hidden = x.shape
    h = np.empty((rows, hidden), np.float32)
    cpu_gemm.product(attended, o_weight, h, parallel)
    cpu_low_rank.add(attended, h, o_lora, lora_rows, parallel)
    if o_bias.shape[0]:
        h += o_bias
    h += x
    normed = np.empty((rows, hidden), np.float32)
    cpu_loops.rms_norm(h, norm, eps, normed)
    gate_up = np.empty((rows, gate_up_weight.shape[0]), np.float32)
    cpu_gemm.product(normed, gate_up_weight, gate_up, parallel)
    if gate_up_bias.shape[0]:
        gate_up += gate_up_bias
    inner = gate_up.shape[1] // 2
    cpu_low_rank.add(normed, gate_up[:, :inner], gate_lora, lora_rows, parallel)
    cpu_low_rank.add(normed, gate_up[:, inner:], up_lora, lora_rows, parallel)
    activated = np.empty((rows, gate_up.shape[1] // 2), np.float32)
    cpu_loops.silu_mul_halves(gate_up, activated)
    out = np.empty((rows, hidden), np.float32)
    cpu_gemm.product(activated, down_weight, out, parallel)
    cpu_low_rank.add(activated, out, down_lora, lora_rows, parallel)
    if down_bias.shape[0]:
        out += down_bias
    out += h
    return out
