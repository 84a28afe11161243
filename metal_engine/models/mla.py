"""Multi-head latent attention (DeepSeek V2/V3, Kimi K2, GLM-4.7-Flash, Mistral 4) over a paged
pool of latents.

A token's row in its layer's pool is `kv_lora_rank + qk_rope_head_dim` wide (576 for
DeepSeek V3, against 2 x 128 heads x 192 for the keys and values it stands for): its
normed latent `c`, then its rope key, shared by every head. A request's rows of a step
attend in one of two forms, the cheaper in FLOPs for its rows and keys. For n rows over c
cached keys, P (row, key) pairs under the causal mask and r = kv_lora_rank, expanded is
cheaper when `c r (nope + v) < P (2 r - nope - v)`: every fresh prompt's chunk, and past
~171 rows (DeepSeek V3; GLM-4.7-Flash ~398) over a long cache (models/mla_forms.py has the
sums and the measurements):

- absorbed: a head's key is `W_uk c` beside the rope key, so its query's score
  `q_nope . W_uk c` is `(W_uk^T q_nope) . c`; the query goes into the latent space once and
  attends over the latent rows as multi-query attention of one key head, whose values are
  the latents themselves; each head's output then leaves through its `W_uv`. Every decode
  row, and chunks short against their cached context; on Metal, the paged decode kernel.
- expanded: the context's latents are gathered from the pool and up-projected to each
  head's nope key (the rope key broadcast beside it) and value, and the chunk's rows attend
  over them as ordinary causal attention of `nope + rope` wide keys and `v_head_dim` values
  (`Ops.chunk_attention`: MLX's fused attention on Metal, cpu_prefill's folded blocks on the
  CPU backend). A fresh prompt's chunks, and chunks long against their cached context.

Either form reads the pool after the step's rows are written, so a quantized pool's
latents are the same dequantized values in both.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from kernels_metal.metadata import AttentionMetadata
from metal_engine.cache.kv_cache import KVCache
from metal_engine.loading.model_config import ModelConfig
from metal_engine.models.layers import Linear, RMSNorm
from metal_engine.models.mla_forms import FormCosts, form_plan
from metal_engine.models.ops_user import OpsUser

# transformers' DeepSeek norms of the q and kv latents keep their class's eps, not the
# config's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


class MlaAttention(nn.Module, OpsUser):
    """Parameter names are transformers' (`q_a_proj`, `kv_a_proj_with_mqa`, `kv_b_proj`, ...).
    Runs on MLX arrays only: the CPU backend's host loops do not take it."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        mla = cfg.mla
        assert mla is not None, "an MLA layer needs the config's MLA shape"
        self.num_heads, self.layer = cfg.num_attention_heads, layer
        self.rank, self.nope, self.rope_dim = (mla.kv_lora_rank, mla.qk_nope_head_dim,
                                               mla.qk_rope_head_dim)
        self.v_head_dim = mla.v_head_dim
        self.scale = mla.qk_head_dim ** -0.5 * _yarn_mscale(cfg) ** 2
        hidden, heads, bias = cfg.hidden_size, cfg.num_attention_heads, cfg.attention_bias
        if mla.q_lora_rank is None:
            self.q_proj = Linear(hidden, heads * mla.qk_head_dim, bias=False)
        else:
            self.q_a_proj = Linear(hidden, mla.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, eps=LATENT_NORM_EPS)
            self.q_b_proj = Linear(mla.q_lora_rank, heads * mla.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(hidden, mla.latent_width, bias=bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, eps=LATENT_NORM_EPS)
        self.kv_b_proj = Linear(mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim),
                                bias=False)
        self.o_proj = Linear(heads * mla.v_head_dim, hidden, bias=bias)
        self._absorbed_weights = _AbsorbedWeights(heads, mla.qk_nope_head_dim, mla.kv_lora_rank)
        self.form_costs = FormCosts.of(mla)  # what decides each request's form

    def __call__(self, x: mx.array, rope, meta: AttentionMetadata, cache: KVCache,
                 pool: int) -> mx.array:
        total, heads = x.shape[0], self.num_heads
        q = self._queries(x).reshape(total, heads, self.nope + self.rope_dim)
        q = self.scale_queries(q, meta)
        q_nope = q[..., : self.nope]
        q_rope = self.ops.rope(q[..., self.nope :], rope).astype(q.dtype)
        plan = form_plan(meta, self.form_costs)
        k_pool, v_pool = cache.take(pool)
        try:
            k_pool = self.ops.write_kv(k_pool, self._latent_rows(x, rope), meta)
            parts = [self._expanded(q_nope[rows], q_rope[rows], k_pool, meta, request)
                     for request, rows in plan.expanded]
            if plan.absorbed is not None:
                rows = plan.absorbed_rows
                absorbed = (q_nope, q_rope) if rows is None else (q_nope[rows], q_rope[rows])
                parts.insert(0, self._absorbed(*absorbed, k_pool, plan.absorbed))
        finally:
            cache.put(pool, k_pool, v_pool)
        out = plan.packed(parts)  # [total, heads, v_head_dim]
        return self.o_proj(out.reshape(total, heads * self.v_head_dim))

    def _absorbed(self, q_nope: mx.array, q_rope: mx.array, pool,
                  meta: AttentionMetadata) -> mx.array:
        """The rows attended over the latent pool as it is: `[rows, heads, v_head_dim]`."""
        queries = self.latent_queries(q_nope, q_rope)
        return self.out_of_latent(self.ops.latent_attention(queries, pool, self.rank, meta,
                                                            self.scale))

    def latent_queries(self, q_nope: mx.array, q_rope: mx.array) -> mx.array:
        """Each head's query taken into the latent space (`W_uk^T q_nope`), then its rope
        part: `[rows, heads, rank + rope]`."""
        w_uk, _ = self._absorbed_weights(self.kv_b_proj)
        q_latent = mx.swapaxes(mx.swapaxes(q_nope, 0, 1) @ w_uk, 0, 1)
        return mx.concatenate([q_latent, q_rope.astype(q_latent.dtype)], axis=-1)

    def out_of_latent(self, out: mx.array) -> mx.array:
        """Each head's latent output `[rows, heads, rank]` through its `W_uv`:
        `[rows, heads, v_head_dim]`."""
        _, w_uv = self._absorbed_weights(self.kv_b_proj)
        return mx.swapaxes(mx.swapaxes(out, 0, 1) @ w_uv, 0, 1)

    def _expanded(self, q_nope: mx.array, q_rope: mx.array, pool, meta: AttentionMetadata,
                  request: int) -> mx.array:
        """One request's chunk attended over its context's latents up-projected to each
        head's keys (nope part, then the shared rope key) and values: `[rows, heads, v]`."""
        latents = self.ops.gather_context(pool, meta, request, q_nope.dtype)[:, 0]
        keys, heads = latents.shape[0], self.num_heads
        # One product for all heads, then heads first, as the attention takes them.
        kv = self.kv_b_proj(latents[:, : self.rank]).reshape(keys, heads, -1)
        kv = mx.swapaxes(kv, 0, 1)  # [heads, keys, nope + v]
        k_rope = mx.broadcast_to(latents[None, :, self.rank :], (heads, keys, self.rope_dim))
        k = mx.concatenate([kv[..., : self.nope], k_rope.astype(kv.dtype)], axis=-1)
        q = mx.swapaxes(mx.concatenate([q_nope, q_rope], axis=-1), 0, 1)
        out = self.ops.chunk_attention(q, k, kv[..., self.nope :], self.scale)
        return mx.swapaxes(out, 0, 1)

    def write_kv(self, x: mx.array, rope, meta: AttentionMetadata, cache: KVCache,
                 pool: int) -> None:
        """Only the rows' latents, written into pool `pool` (a speculative head's follow
        pass, metal_engine.drafting.mtp)."""
        k_pool, v_pool = cache.take(pool)
        try:
            k_pool = self.ops.write_kv(k_pool, self._latent_rows(x, rope), meta)
        finally:
            cache.put(pool, k_pool, v_pool)

    def _latent_rows(self, x: mx.array, rope) -> mx.array:
        """The rows' pool rows `[total, 1, rank + rope]`: normed latent, then rope key."""
        compressed = self.kv_a_proj_with_mqa(x)
        latent = self.kv_a_layernorm(compressed[:, : self.rank])
        k_rope = self.ops.rope(compressed[:, None, self.rank :], rope)
        return mx.concatenate([latent[:, None], k_rope.astype(latent.dtype)], axis=-1)

    def scale_queries(self, queries: mx.array, meta: AttentionMetadata) -> mx.array:
        """The rows' queries `[total, heads, nope + rope]` as they attend: as they are (a
        family may scale them by row, models/mistral4.py; before the rope and in either form
        alike, as a row's scalar commutes with both)."""
        return queries

    def _queries(self, x: mx.array) -> mx.array:
        if "q_proj" in self:
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))



def rope_pairs_as_halves(weights: dict[str, mx.array], cfg: ModelConfig) -> dict[str, mx.array]:
    """`weights` (a checkpoint's, by name) with DeepSeek's paired rope dims made halves.

    With `rope_interleave` the rope turns neighbouring dims (0, 1), (2, 3), ... of q's and k's
    rope parts; the rope here turns the first half against the second. Taking the rows of
    `q_proj` / `q_b_proj` and `kv_a_proj_with_mqa` that make those parts evens first, then
    odds, makes the pairs the halves, and the scores are the same (q and k are reordered
    alike): once at load, not a gather per layer and step. Rows are outputs, so a quantized
    projection's packed rows, scales and biases move as they are."""
    mla = cfg.mla
    if mla is None or not mla.rope_interleave:
        return weights
    rope, nope = mla.qk_rope_head_dim, mla.qk_nope_head_dim
    halves = np.concatenate([np.arange(0, rope, 2), np.arange(1, rope, 2)])
    q_rows = np.arange(cfg.num_attention_heads * (nope + rope)).reshape(-1, nope + rope)
    q_rows[:, nope:] = q_rows[:, nope:][:, halves]
    kv_rows = np.concatenate([np.arange(mla.kv_lora_rank), mla.kv_lora_rank + halves])
    orders = {"q_proj": q_rows.ravel(), "q_b_proj": q_rows.ravel(),
              "kv_a_proj_with_mqa": kv_rows}
    return reorder_rows(weights, ".self_attn.", orders)


def reorder_rows(weights: dict[str, mx.array], scope: str,
                 orders: dict[str, np.ndarray]) -> dict[str, mx.array]:
    """`weights` with the output rows of each projection named in `orders` (under a module
    path containing `scope`) taken in that order: its weight, and a quantized one's scales
    and biases alike."""
    out = dict(weights)
    for name, tensor in weights.items():
        module, _, kind = name.rpartition(".")
        projection = module.rpartition(".")[2]
        if scope in name and projection in orders and kind in PROJECTION_ROWS:
            out[name] = tensor[mx.array(orders[projection])]
    return out


PROJECTION_ROWS = ("weight", "bias", "scales", "biases")  # what a projection keeps per output


class _AbsorbedWeights:
    """`kv_b_proj`'s weight as each head's `W_uk^T [rank -> nope]` turned to take queries
    (`[heads, nope, rank]`) and `W_uv^T` (`[heads, rank, v]`), float or dequantized, made
    again when the weight is replaced."""

    def __init__(self, heads: int, nope: int, rank: int) -> None:
        self._shape = (heads, -1, rank)
        self._nope = nope
        self._source: mx.array | None = None
        self._weights: tuple[mx.array, mx.array] | None = None

    def __call__(self, linear: nn.Module) -> tuple[mx.array, mx.array]:
        weight = linear.weight
        if weight is not self._source or self._weights is None:
            self._source = weight
            if isinstance(linear, nn.QuantizedLinear):
                weight = mx.dequantize(weight, linear.scales, linear.get("biases"),
                                       linear.group_size, linear.bits, linear.mode)
            per_head = weight.reshape(self._shape)  # [heads, nope + v, rank]
            w_uk = per_head[:, : self._nope]
            w_uv = mx.swapaxes(per_head[:, self._nope :], 1, 2)
            self._weights = (mx.contiguous(w_uk), mx.contiguous(w_uv))
            mx.eval(self._weights)
        return self._weights


def _yarn_mscale(cfg: ModelConfig) -> float:
    """DeepSeek's YaRN also scales the softmax, by the square of this (transformers'
    `yarn_apply_mscale`)."""
    rope = cfg.rope
    if rope.rope_type == "default" or not rope.mscale_all_dim or (rope.factor or 1) <= 1:
        return 1.0
    return 0.1 * rope.mscale_all_dim * math.log(rope.factor) + 1.0
