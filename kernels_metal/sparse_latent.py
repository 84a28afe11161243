"""DeepSeek sparse attention (DSA: DeepSeek V3.2, GLM-5) over a paged latent pool, in pure MLX:
each query row's top-k keys by its indexer's scores, then multi-head latent attention over
those keys alone. There is no kernel for it yet; every backend runs this.

A pool row of an indexing layer is the token's latent, its rope key, then its index key:

    | latent (kv_lora_rank) | rope key | index key (index_head_dim) |
    0                       rank       key_offset

Rows go in the reference's groups (kernels_metal.reference): the step's single-row requests
together (contexts padded to the longest, the padding never visible), each longer chunk
alone. A row sees keys up to its own position; of those it attends the `top_k` best scored
(all of them while they are no more). The two kinds of group attend the same keys in the
way that costs them less: a single row gathers its k chosen latent rows (k x width, against
heads x context for scores over the whole context), while a chunk's rows share one gathered
context and mask out the keys they did not choose (heads x context a row, not k x width).
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx

from kernels_metal.metadata import AttentionMetadata
from kernels_metal.reference import (
    AttentionGroup,
    Pool,
    gather_kv,
    masked_softmax,
    reference_plan,
)


class ChosenKeys(NamedTuple):
    """One group's choice: `allowed [G, n, k]` over its `keys [G, n, k]` (positions, each
    row its own), or, with `keys` None, `allowed [G, n, L]` over the whole context."""

    keys: mx.array | None
    allowed: mx.array


Selection = tuple[ChosenKeys, ...]  # one per group of the step's reference plan


def select_keys(queries: mx.array, weights: mx.array, pool: Pool, key_offset: int,
                meta: AttentionMetadata, top_k: int) -> Selection:
    """Each row's `top_k` keys among positions up to its own, by the indexer's score
    `sum_h weights[h] * relu(queries[h] . key)`: `queries [total_q, Hi, Di]` (turned by the
    rope), `weights [total_q, Hi]` (the softmax scale folded in), the keys the pool rows'
    values from `key_offset` on. Scores in float32, as transformers takes them."""
    return tuple(_select(queries, weights, pool, key_offset, group, top_k)
                 for group in reference_plan(meta).groups)


def _select(queries: mx.array, weights: mx.array, pool: Pool, key_offset: int,
            group: AttentionGroup, top_k: int) -> ChosenKeys:
    visible = group.mask[:, 0, 0]  # [G, n, L]
    if top_k >= group.num_keys:  # no row has more keys to see than it may choose
        return ChosenKeys(None, visible)
    keys = gather_kv(pool, group.tables, group.num_keys)[:, 0, :, key_offset:]  # [G, L, Di]
    num_groups, num_keys = keys.shape[:2]
    heads, dim = queries.shape[1:]
    q = queries[group.rows].astype(mx.float32).reshape(num_groups, -1, dim)  # [G, n Hi, Di]
    scores = mx.maximum(q @ mx.swapaxes(keys, 1, 2), 0).reshape(num_groups, -1, heads, num_keys)
    w = weights[group.rows].astype(mx.float32).reshape(num_groups, -1, 1, heads)
    index = mx.where(visible, (w @ scores)[:, :, 0], -mx.inf)  # [G, n, L]
    chosen = mx.argpartition(-index, kth=top_k - 1, axis=-1)[..., :top_k]
    if group.is_decode:
        return ChosenKeys(chosen, mx.take_along_axis(visible, chosen, axis=-1))
    picked = mx.put_along_axis(mx.zeros(index.shape, mx.bool_), chosen, mx.array(True), axis=-1)
    return ChosenKeys(None, visible & picked)


def selected_latent_attention(q: mx.array, pool: Pool, selection: Selection, rank: int,
                              meta: AttentionMetadata, scale: float) -> mx.array:
    """Absorbed multi-head latent attention of `q [total_q, H, W]` (each head's query in the
    latent space, then its rope part) over the keys `selection` chose, whose rows' first W
    values are their keys and first `rank` their values: `[total_q, H, rank]`."""
    plan = reference_plan(meta)
    parts = [_attend(q, pool, group, chosen, rank, scale)
             for group, chosen in zip(plan.groups, selection, strict=True)]
    out = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)
    if plan.row_order is not None:
        out = out[plan.row_order]
    return out.astype(q.dtype)


def _attend(q: mx.array, pool: Pool, group: AttentionGroup, chosen: ChosenKeys, rank: int,
            scale: float) -> mx.array:
    heads, width = q.shape[1:]
    latents = gather_kv(pool, group.tables, group.num_keys)[:, 0, :, :width]  # [G, L, W]
    num_groups, num_keys = latents.shape[:2]
    rows = q[group.rows].astype(mx.float32).reshape(num_groups, -1, heads, width)
    if chosen.keys is not None:  # each row its own k latent rows: [G, n, k, W]
        flat = mx.arange(num_groups)[:, None, None] * num_keys + chosen.keys
        latents = latents.reshape(-1, width)[flat]
        scores = rows @ mx.swapaxes(latents, -1, -2) * scale  # [G, n, H, k]
        probs = masked_softmax(scores, chosen.allowed[:, :, None, :])
        return (probs @ latents[..., :rank]).reshape(-1, heads, rank)
    n = rows.shape[1]
    scores = rows.reshape(num_groups, n * heads, width) @ mx.swapaxes(latents, 1, 2) * scale
    scores = scores.reshape(num_groups, n, heads, num_keys)
    probs = masked_softmax(scores, chosen.allowed[:, :, None, :]).reshape(num_groups, -1, num_keys)
    return (probs @ latents[..., :rank]).reshape(-1, heads, rank)
