"""The operations model code calls, one implementation per backend, chosen once per model.

    Ops             the interface: products, norms, rope, activations, attention (paged, latent,
                    sparse latent, over a gathered context, dense over an encoder's rows),
                    gated delta, KV writes, and how a decoder runs its layers
    ReferenceOps    pure MLX: what every kernel is checked against; runs anywhere
    MetalOps        the Metal path: `mx.fast` rope and norms, fused products, compiled
                    elementwise chains, the paged-attention and gated-delta kernels
    HostOps         the CPU host loops (kernels_metal.cpu.ops): MLX's CPU backend

`kernels_metal.backends` builds one by name and names the device's. A model takes its ops
when it is built (`metal_engine.models.ops_user`); no model code asks which backend runs.
Every method takes the arrays its backend's layers hand it and returns the same kind.
"""

from __future__ import annotations

from functools import partial
from typing import Literal

import mlx.core as mx
import mlx.nn as nn

from kernels_metal import attention, fast_rope, gated_delta, sparse_latent
from kernels_metal.fast_rope import RotaryTables
from kernels_metal.metadata import AttentionMetadata
from kernels_metal.reference import (
    causal_chunk_attention,
    gather_context,
    paged_attention_reference,
    write_kv,
)
from metal_engine.models import gated_delta_rule as gated_delta_reference

OpsName = Literal["metal", "reference", "host"]
Activation = Literal["silu", "gelu_pytorch_tanh"]


class Ops:
    """What a layer computes with. `layer`s are anything with `get("weight")` and
    `get("bias")` (a `Linear`, or `PackedLinears`: several as one)."""

    name: OpsName
    expert_dispatch: Literal["gather", "grouped"] = "gather"  # models/moe.py says how each runs
    # Whether building a forward evaluates it (host loops read their inputs): the runner
    # then waits for the step in flight first, or each K/V write would copy its pool.
    evaluates_while_building: bool = False

    def linear(self, x, layer):
        """`x @ weight.T + bias`."""
        return product(x, layer.get("weight"), layer.get("bias"))

    def low_rank(self, x, a, b, indices, sorted_indices: bool = False):
        """LoRA deltas: each row's `(x @ a[i]) @ b[i]`, `i` its entry of `indices`, in two
        gathered products (rows of one index multiply together; no product per adapter).
        `x [..., 1, in]`, `a [n, in, r]`, `b [n, r, out]`, `indices` broadcasting against
        `x`'s leading axes; `sorted_indices`: they are in increasing order."""
        z = mx.gather_mm(x, a, rhs_indices=indices, sorted_indices=sorted_indices)
        return mx.gather_mm(z, b, rhs_indices=indices, sorted_indices=sorted_indices)

    def linears(self, x, packed) -> list:
        """`x` through each linear of a `PackedLinears`, in its order."""
        return [linear(x) for linear in packed.linears()]  # quantized ones their own way

    def gated(self, x, packed, act: Activation):
        """`act(gate(x)) * up(x)`; `packed`: a gate/up `PackedLinears`, or one fused linear
        whose output halves are gate and up."""
        gate, up = self._gate_up(x, packed)
        return self.activation(act, gate, up)

    def _gate_up(self, x, packed):
        if hasattr(packed, "linears"):
            return self.linears(x, packed)
        return mx.split(packed(x), 2, axis=-1)

    def activation(self, act: Activation, gate, up):
        return GATED[act](gate, up)

    def silu(self, x):
        return nn.silu(x)

    def exp(self, x):
        return mx.exp(x)

    def softcap(self, x, cap: float):
        """`cap * tanh(x / cap)`: squashes x smoothly into (-cap, cap)."""
        return mx.tanh(x / cap) * cap

    def rms_norm(self, x, weight, eps: float):
        """`x / sqrt(mean(x^2) + eps) * weight` over the last axis (no weight: 1)."""
        return mx.fast.rms_norm(x, weight, eps)

    def layer_norm(self, x, weight, bias, eps: float):
        """`(x - mean) / sqrt(var + eps) * weight + bias` over the last axis."""
        return mx.fast.layer_norm(x, weight, bias, eps)

    def rope_step(self, rope, positions: mx.array, meta: AttentionMetadata):
        """What a `models.rope.RotaryEmbedding` needs for a step's rows at `positions`
        (built once, used by every layer of its kind): here float32 cos/sin tables."""
        return RotaryTables(rope, positions, meta)

    def rope(self, x, step):
        """`x [total_q, heads, head_dim]` turned by a `rope_step`."""
        return step(x)

    def layer_ropes(self, ropes, positions: mx.array, meta: AttentionMetadata) -> list:
        """Each layer's rope step (`ropes`: a `models.rope.LayerRopes`), one per kind."""
        steps = [self.rope_step(r, positions, meta) for r in ropes.embeddings]
        return [steps[ropes.kind(i)] for i in range(ropes.num_layers)]

    def write_kv(self, pool, new, meta: AttentionMetadata):
        return write_kv(pool, new, meta)

    def paged_attention(self, q, k_pool, v_pool, meta: AttentionMetadata, scale: float,
                        window=None, softcap=None, sinks=None):
        return self.attention_without_kernels(q, k_pool, v_pool, meta, scale, window, softcap,
                                              sinks)

    def attention_without_kernels(self, q, k_pool, v_pool, meta: AttentionMetadata,
                                  scale: float, window=None, softcap=None, sinks=None):
        """Attention where no kernel serves (this backend's own): the pure-MLX reference."""
        return paged_attention_reference(q, k_pool, v_pool, meta, scale, window, softcap,
                                         sinks)

    def latent_attention(self, q, pool, rank: int, meta: AttentionMetadata, scale: float):
        """Multi-head latent attention in its absorbed form: `q [total_q, H, W]` over a pool
        of latent rows `[blocks, block_size, 1, W]` whose first `rank` values are also the
        values; `[total_q, H, rank]` out. Here the pure-MLX reference."""
        return attention.latent_reference(q, pool, rank, meta, scale)

    def select_keys(self, queries, weights, pool, key_offset: int, meta: AttentionMetadata,
                    top_k: int) -> sparse_latent.Selection:
        """DeepSeek sparse attention's choice of each row's `top_k` keys by its indexer's
        `queries [total_q, Hi, Di]` and head `weights [total_q, Hi]` against the index keys
        the pool rows hold from `key_offset` on. Every backend: the pure-MLX reference
        (kernels_metal.sparse_latent), as no kernel serves it yet."""
        return sparse_latent.select_keys(queries, weights, pool, key_offset, meta, top_k)

    def selected_latent_attention(self, q, pool, selection: sparse_latent.Selection, rank: int,
                                  meta: AttentionMetadata, scale: float):
        """`latent_attention` of each row over the keys `selection` chose for it alone. Every
        backend: the pure-MLX reference."""
        return sparse_latent.selected_latent_attention(q, pool, selection, rank, meta, scale)

    def gather_context(self, pool, meta: AttentionMetadata, request: int, dtype: mx.Dtype):
        """Request `request`'s rows of `pool`, written this step's too, as one contiguous
        `[seq_len, kv_heads, head_dim]` in `dtype` (a quantized pool's dequantized)."""
        return gather_context(pool, meta, request, dtype)

    def chunk_attention(self, q, k, v, scale: float):
        """Causal attention of one request's chunk rows, heads first: `q [H, n, D]` (its last
        n positions) over its keys `k [H, L, D]` and values `v [H, L, Dv]`: `[H, n, Dv]`."""
        return causal_chunk_attention(q, k, v, scale)

    def dense_attention(self, q, k, v, scale: float):
        """Bidirectional attention with no cache (a vision tower's patches): every row of `q
        [B, H, n, D]` over every key of `k`, `v` `[B, kv_heads, n, D]`; `[B, H, n, D]` out."""
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)

    def write_and_attend(self, q, k, v, k_pool, v_pool, meta: AttentionMetadata, scale: float,
                         window=None, softcap=None, sinks=None):
        """K/V rows written into the pools, then q attended over them: (out, k_pool, v_pool)."""
        k_pool, v_pool = self.write_kv(k_pool, k, meta), self.write_kv(v_pool, v, meta)
        out = self.paged_attention(q, k_pool, v_pool, meta, scale, window, softcap, sinks)
        return out, k_pool, v_pool

    def gated_delta_rule(self, q, k, v, g, beta, cu_seqlens, initial_state,
                         normalize_qk: bool = True):
        return gated_delta_reference.gated_delta_rule(q, k, v, g, beta, cu_seqlens,
                                                      initial_state, normalize_qk)

    def grouped_experts(self, glu, x, experts, weights):
        raise NotImplementedError(f"the {self.name} backend runs experts gathered")

    def run_layers(self, decoder, h, positions: mx.array, meta: AttentionMetadata, cache,
                   layers: range):
        """`h` through a `models.decoder.DecoderModel`'s layers `layers` (each writing its
        pool of `cache`), MLX arrays in and out."""
        ropes = self.layer_ropes(decoder.ropes, positions, meta)
        modules, pools = decoder["layers"], decoder.pools
        for i in layers:
            h = modules[i](h, ropes[i], meta, cache, pools[i])
        return h

    def parameters_changed(self) -> None:
        """The model's parameters were replaced (a backend may have derived from them)."""

    def settle(self, parameters: list[mx.array]) -> None:
        """The model is loaded and warmed up (its q/k/v packed): place what the backend
        streams where it reads fastest. Nothing to do by default."""


class ReferenceOps(Ops):
    name = "reference"


class DispatchedKernels:
    """Attention and the gated delta rule through their checked dispatchers
    (kernels_metal.dispatch): kernels where they serve, else the backend's own path."""

    def paged_attention(self, q, k_pool, v_pool, meta: AttentionMetadata, scale: float,
                        window=None, softcap=None, sinks=None):
        return attention.paged_attention(q, k_pool, v_pool, meta, scale, window, softcap,
                                         sinks, self.attention_without_kernels)

    def write_and_attend(self, q, k, v, k_pool, v_pool, meta: AttentionMetadata, scale: float,
                         window=None, softcap=None, sinks=None):
        return attention.write_and_attend(q, k, v, k_pool, v_pool, meta, scale, window,
                                          softcap, sinks, self.attention_without_kernels)

    def latent_attention(self, q, pool, rank: int, meta: AttentionMetadata, scale: float):
        return attention.latent_attention(q, pool, rank, meta, scale)

    def gated_delta_rule(self, q, k, v, g, beta, cu_seqlens, initial_state,
                         normalize_qk: bool = True):
        return gated_delta.gated_delta_rule(q, k, v, g, beta, cu_seqlens, initial_state,
                                            normalize_qk)


class MetalOps(DispatchedKernels, Ops):
    """The lean Metal graph: one kernel where MLX has one (`mx.fast`), products of several
    linears of one input as one, and elementwise chains compiled into one kernel each."""

    name = "metal"

    def linears(self, x, packed) -> list:
        weights = packed.packed()
        if weights is None:
            return super().linears(x, packed)
        return packed.split(product(x, *weights))

    def activation(self, act: Activation, gate, up):
        return COMPILED_GATED[act](gate, up)

    def softcap(self, x, cap: float):
        return _compiled_softcap(x, mx.array(cap, x.dtype))

    def rope_step(self, rope, positions: mx.array, meta: AttentionMetadata):
        return fast_rope.rope_step(rope, positions, meta)

    def write_kv(self, pool, new, meta: AttentionMetadata):
        return attention.write_kv(pool, new, meta)



def product(x: mx.array, weight: mx.array, bias: mx.array | None = None) -> mx.array:
    return x @ weight.T if bias is None else mx.addmm(bias, x, weight.T)


def silu_mul(gate: mx.array, up: mx.array) -> mx.array:
    """SwiGLU's `silu(gate) * up`."""
    return nn.silu(gate) * up


def gelu_tanh_mul(gate: mx.array, up: mx.array) -> mx.array:
    """GeGLU's `gelu_tanh(gate) * up` (transformers' `gelu_pytorch_tanh`, as in Gemma)."""
    return nn.gelu_approx(gate) * up


GATED = {"silu": silu_mul, "gelu_pytorch_tanh": gelu_tanh_mul}
# One kernel each on Metal, as mlx-lm compiles its activations.
COMPILED_GATED = {k: mx.compile(f, shapeless=True) for k, f in GATED.items()}


@partial(mx.compile, shapeless=True)
def _compiled_softcap(x: mx.array, cap: mx.array) -> mx.array:
    return mx.tanh(x / cap) * cap
