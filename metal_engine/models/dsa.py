"""DeepSeek V3.2 (deepseek_v32) and GLM-5 (glm_moe_dsa): DeepSeek V3's layers whose latent
attention is sparse (DeepSeek sparse attention, DSA). Each query attends to at most
`index_topk` of the keys it may see, those a small indexer scores best:

    score(query t, key s) = sum_h w_h(x_t) relu(q_h(t) . k(s)) / sqrt(index_head_dim)

with `index_n_heads` query heads `q_h` from the query's low-rank latent, one key `k` a token
(layer-normed, the first `qk_rope_head_dim` of both turned by the model's rope: halves for
DeepSeek, pairs for GLM-5) and a weight per head from the hidden state. A key is kept per
token after its latent row in the layer's pool (models/dsa_config.py), so prefix hits,
preemption, the disk tier and the memory plan carry it as they carry the latent. The choice
and the attention over the chosen keys run in pure MLX on every backend
(kernels_metal.sparse_latent). GLM-5's "shared" layers reuse the choice of the indexing layer
before them in the same step.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from kernels_metal.metadata import AttentionMetadata
from kernels_metal.sparse_latent import Selection
from metal_engine.cache.kv_cache import KVCache
from metal_engine.loading.model_config import ModelConfig
from metal_engine.models import deepseek_v3
from metal_engine.models.layers import Linear
from metal_engine.models.mla import MlaAttention, reorder_rows
from metal_engine.models.ops_user import OpsUser

INDEX_KEY_NORM_EPS = 1e-6  # transformers' indexer LayerNorm keeps its own eps
_SELECTION = "dsa-selection"  # the step's latest choice, in its metadata's per-step plans


class Indexer(nn.Module, OpsUser):
    """The indexer's projections, under transformers' names (`wq_b`, `wk`, `k_norm`,
    `weights_proj`)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        indexer, mla = cfg.indexer, cfg.mla
        self.num_heads, self.head_dim = indexer.num_heads, indexer.head_dim
        self.rope_dim = mla.qk_rope_head_dim
        if self.head_dim < self.rope_dim:
            raise ValueError(f"index_head_dim ({self.head_dim}) must be at least "
                             f"qk_rope_head_dim ({self.rope_dim}): the rope turns that much of it")
        self.wq_b = Linear(mla.q_lora_rank, self.num_heads * self.head_dim, bias=False)
        self.wk = Linear(cfg.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=INDEX_KEY_NORM_EPS)
        self.weights_proj = Linear(cfg.hidden_size, self.num_heads, bias=False)
        # Both scales fold into the head weights: relu(s q.k) = s relu(q.k) for s > 0.
        self._weight_scale = (self.num_heads * self.head_dim) ** -0.5

    def keys(self, x: mx.array, rope) -> mx.array:
        """The rows' index keys `[total, 1, head_dim]`."""
        return self._turned(self.k_norm(self.wk(x))[:, None], rope)

    def queries(self, q_latent: mx.array, x: mx.array, rope) -> tuple[mx.array, mx.array]:
        """The rows' index queries `[total, heads, head_dim]` from the attention's normed q
        latent, and their head weights `[total, heads]` from the hidden state."""
        q = self.wq_b(q_latent).reshape(x.shape[0], self.num_heads, self.head_dim)
        weights = self.weights_proj(x).astype(mx.float32) * self._weight_scale
        return self._turned(q, rope), weights

    def _turned(self, x: mx.array, rope) -> mx.array:
        turned = self.ops.rope(x[..., : self.rope_dim], rope).astype(x.dtype)
        return mx.concatenate([turned, x[..., self.rope_dim :]], axis=-1)


class DsaAttention(MlaAttention):
    """Latent attention over the keys each row's indexer chose (or, on a shared layer, the
    previous indexing layer chose), in the absorbed form."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__(cfg, layer)
        if "q_a_proj" not in self:
            raise ValueError(f"{cfg.model_type} needs q_lora_rank: its indexer reads the "
                             "query's low-rank latent")
        self.top_k = cfg.indexer.top_k
        self.indexer = Indexer(cfg) if cfg.indexer.indexes(layer) else None

    def __call__(self, x: mx.array, rope, meta: AttentionMetadata, cache: KVCache,
                 pool: int) -> mx.array:
        total, heads = x.shape[0], self.num_heads
        q_latent = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_latent).reshape(total, heads, self.nope + self.rope_dim)
        q = self.scale_queries(q, meta)
        q_rope = self.ops.rope(q[..., self.nope :], rope).astype(q.dtype)
        queries = self.latent_queries(q[..., : self.nope], q_rope)
        k_pool, v_pool = cache.take(pool)
        try:
            k_pool = self.ops.write_kv(k_pool, self._latent_rows(x, rope), meta)
            selection = self._selection(x, q_latent, rope, k_pool, meta)
            out = self.ops.selected_latent_attention(queries, k_pool, selection, self.rank,
                                                     meta, self.scale)
        finally:
            cache.put(pool, k_pool, v_pool)
        out = self.out_of_latent(out)  # [total, heads, v_head_dim]
        return self.o_proj(out.reshape(total, heads * self.v_head_dim))

    def _latent_rows(self, x: mx.array, rope) -> mx.array:
        """The rows' pool rows: latent, rope key, then (an indexing layer's) index key."""
        rows = super()._latent_rows(x, rope)
        if self.indexer is None:
            return rows
        return mx.concatenate([rows, self.indexer.keys(x, rope).astype(rows.dtype)], axis=-1)

    def _selection(self, x: mx.array, q_latent: mx.array, rope, pool,
                   meta: AttentionMetadata) -> Selection:
        """This layer's choice of keys, kept for the shared layers after it in the step."""
        if self.indexer is None:
            if _SELECTION not in meta.backend_plans:
                raise RuntimeError(f"layer {self.layer} reuses an indexing layer's choice, but "
                                   "none ran before it in this step")
            return meta.backend_plans[_SELECTION]
        queries, weights = self.indexer.queries(q_latent, x, rope)
        selection = self.ops.select_keys(queries, weights, pool, self.rank + self.rope_dim,
                                         meta, self.top_k)
        meta.backend_plans[_SELECTION] = selection
        return selection


def index_pairs_as_halves(weights: dict[str, mx.array], cfg: ModelConfig) -> dict[str, mx.array]:
    """`weights` with GLM-5's paired index rope dims made halves, as `rope_pairs_as_halves`
    does for the latent attention's: the rows of `wq_b` (each head's first rope dims) and of
    `wk` and its norm that make the turned part, evens first, then odds. The scores are the
    same (queries and keys reordered alike; the norm acts per feature)."""
    if cfg.indexer is None or not cfg.indexer.rope_interleave:
        return weights
    rope, width = cfg.mla.qk_rope_head_dim, cfg.indexer.head_dim
    key_rows = np.arange(width)
    key_rows[:rope] = np.concatenate([np.arange(0, rope, 2), np.arange(1, rope, 2)])
    query_rows = (np.arange(cfg.indexer.num_heads)[:, None] * width + key_rows).ravel()
    return reorder_rows(weights, ".indexer.",
                        {"wq_b": query_rows, "wk": key_rows, "k_norm": key_rows})


class Model(deepseek_v3.Model):
    attention = DsaAttention
    mtp_class = None  # their multi-token-prediction layers (with indexers) are not kept

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        return index_pairs_as_halves(super().sanitize(weights), self.config)
