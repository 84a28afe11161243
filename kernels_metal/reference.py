"""Pure-MLX paged attention, KV write and rotary embedding: the reference corner of each
kernel triangle, which runs anywhere and every kernel is checked against."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from kernels_metal.kv_quant import QuantizedPool, gather_blocks, write_quantized
from kernels_metal.metadata import AttentionMetadata

Pool = mx.array | QuantizedPool  # a float K or V pool, or a quantized one


def write_kv(pool: Pool, new: mx.array, meta: AttentionMetadata) -> Pool:
    """Scatter `new [total_q, kv_heads, head_dim]` into `pool` at the step's slots (a
    quantized pool gets the rows' codes and scales).

    The caller must hold no other reference to `pool`, so MLX donates its buffer and the
    scatter happens in place instead of copying the whole pool.
    """
    dev = meta.device
    if isinstance(pool, QuantizedPool):
        return write_quantized(pool, new, dev.slot_block, dev.slot_offset)
    pool[dev.slot_block, dev.slot_offset] = new.astype(pool.dtype)
    return pool


@dataclass(frozen=True)
class AttentionGroup:
    """Query rows attended in one batched call: all decode rows, or one prefill chunk."""

    rows: mx.array | slice  # packed rows of the group
    tables: mx.array  # [G, num_blocks] block ids of the group's requests
    num_keys: int  # keys per request after gathering (the longest context, block-rounded)
    mask: mx.array  # [G, 1, 1, rows per request, num_keys]: True where attention is allowed
    is_decode: bool


@dataclass(frozen=True)
class ReferencePlan:
    groups: list[AttentionGroup]
    row_order: mx.array | None  # concatenated group rows -> packed order; None if already so


def paged_attention_reference(
    q: mx.array, k_pool: Pool, v_pool: Pool, meta: AttentionMetadata, scale: float,
    window: int | None = None, softcap: float | None = None, sinks: mx.array | None = None,
) -> mx.array:
    """Causal varlen attention of packed queries `[total_q, H, D]` over paged K/V.

    Decode rows of all requests go through one batched call; each prefill chunk gets its own
    call with a causal mask offset by its cached prefix (a row sees up to `meta.last_keys`
    where the step has them: an image's tokens see each other). With a `window` a row at
    position p sees keys from `p - window + 1` only; `softcap` squashes scores to
    `cap * tanh(s / cap)`.
    `sinks [H]` (GPT-OSS) adds one logit per head to every row's softmax, after `scale` and
    `softcap` and not scaled by them, with no value: its probability is dropped.
    """
    plan = reference_plan(meta, window)
    parts = [_attend(q, k_pool, v_pool, group, scale, softcap, sinks) for group in plan.groups]
    out = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)
    if plan.row_order is not None:
        out = out[plan.row_order]
    return out.astype(q.dtype)


def reference_plan(meta: AttentionMetadata, window: int | None = None) -> ReferencePlan:
    """The step's groups for layers with this window, made by the first layer that asks."""
    key = ("reference", window)
    if key not in meta.backend_plans:
        meta.backend_plans[key] = build_plan(meta, window)
    return meta.backend_plans[key]


def _attend(q, k_pool, v_pool, group: AttentionGroup, scale: float, cap: float | None,
            sinks: mx.array | None) -> mx.array:
    """Masked softmax attention of one group, the query heads of a KV head batched together."""
    k = gather_kv(k_pool, group.tables, group.num_keys)  # [G, kvh, L, d]
    v = gather_kv(v_pool, group.tables, group.num_keys)
    num_groups, kv_heads, num_keys, head_dim = k.shape
    rows = q[group.rows].astype(mx.float32)  # [n_rows, H, d]
    heads_per_kv = rows.shape[1] // kv_heads
    # Decode: G requests with one row each. Prefill: one request with n rows.
    n = 1 if group.is_decode else rows.shape[0]
    queries = rows.reshape(num_groups, n, kv_heads, heads_per_kv, head_dim)
    queries = queries.transpose(0, 2, 3, 1, 4).reshape(num_groups, kv_heads, -1, head_dim)
    scores = (queries @ mx.swapaxes(k, -1, -2)) * scale  # [G, kvh, g * n, L]
    if cap is not None:
        scores = mx.tanh(scores / cap) * cap
    scores = scores.reshape(num_groups, kv_heads, heads_per_kv, n, num_keys)
    if sinks is None:
        probs = masked_softmax(scores, group.mask, axis=-1)
    else:
        probs = _softmax_with_sinks(scores, group.mask, sinks)
    probs = probs.reshape(num_groups, kv_heads, -1, num_keys)
    value_dim = v.shape[-1]  # the keys' head_dim, or less (MLA's values are part of its keys)
    out = (probs @ v).reshape(num_groups, kv_heads, heads_per_kv, n, value_dim)
    return out.transpose(0, 3, 1, 2, 4).reshape(-1, kv_heads * heads_per_kv, value_dim)


def masked_softmax(x: mx.array, mask: mx.array, axis: int = -1) -> mx.array:
    """Softmax over `axis` of `x` where `mask` (broadcastable bool) is True; 0 elsewhere."""
    return mx.softmax(mx.where(mask, x, -mx.inf), axis=axis, precise=True)


def _softmax_with_sinks(scores: mx.array, mask: mx.array, sinks: mx.array) -> mx.array:
    """Softmax of `scores [G, kvh, g, n, L]` with each head's sink as one more, always
    visible, column, which is then dropped (transformers' GPT-OSS eager attention)."""
    num_groups, kv_heads, heads_per_kv, n, _ = scores.shape
    per_head = sinks.astype(mx.float32).reshape(1, kv_heads, heads_per_kv, 1, 1)
    sink_column = mx.broadcast_to(per_head, (num_groups, kv_heads, heads_per_kv, n, 1))
    visible = mx.ones((*mask.shape[:-1], 1), dtype=mx.bool_)
    probs = masked_softmax(mx.concatenate([scores, sink_column], axis=-1),
                           mx.concatenate([mask, visible], axis=-1), axis=-1)
    return probs[..., :-1]


def gather_kv(pool: Pool, tables: mx.array, num_keys: int) -> mx.array:
    """Blocks `[G, n]` -> `[G, kv_heads, num_keys, head_dim]` in float32."""
    kv = gather_blocks(pool, tables) if isinstance(pool, QuantizedPool) else pool[tables]
    g, n, bs, kvh, d = kv.shape
    kv = kv.reshape(g, n * bs, kvh, d)[:, :num_keys]
    return mx.swapaxes(kv, 1, 2).astype(mx.float32)


def gather_context(pool: Pool, meta: AttentionMetadata, request: int,
                   dtype: mx.Dtype) -> mx.array:
    """Request `request`'s rows of `pool` at positions `0 .. seq_len - 1` (this step's own
    among them once written): `[seq_len, kv_heads, head_dim]` in `dtype`."""
    key = ("context-tables", request)
    if key not in meta.backend_plans:  # made by a step's first layer, used by every layer
        blocks = -(-int(meta.seq_lens[request]) // meta.block_size)
        meta.backend_plans[key] = mx.array(meta.block_tables[request, :blocks])
    tables = meta.backend_plans[key]
    if isinstance(pool, QuantizedPool):
        rows = gather_blocks(pool, tables, dtype)
    else:
        rows = pool[tables].astype(dtype)
    return rows.reshape(-1, *rows.shape[2:])[: int(meta.seq_lens[request])]


def causal_chunk_attention(q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
    """Causal attention of one request's chunk, heads first: `q [H, n, D]`, the rows of its
    last n positions, over all its keys `k [H, L, D]` and values `v [H, L, Dv]`;
    `[H, n, Dv]` out. MLX's own attention, which masks from the bottom right (row i sees keys
    to L - n + i): one fused kernel on Metal where MLX has one for the shape, its matmuls
    elsewhere."""
    out = mx.fast.scaled_dot_product_attention(q[None], k[None], v[None], scale=scale,
                                               mask="causal")
    return out[0]


def build_plan(meta: AttentionMetadata, window: int | None = None) -> ReferencePlan:
    """Group the step's rows once; every layer with this window reuses groups, tables, masks."""
    starts, q_lens = meta.cu_seqlens_q[:-1], np.diff(meta.cu_seqlens_q)
    decode, prefill = np.flatnonzero(q_lens == 1), np.flatnonzero(q_lens > 1)
    groups = []
    if len(decode):
        groups.append(_decode_group(meta, decode, window))
    groups += [_prefill_group(meta, int(r), window) for r in prefill]
    concat_rows = np.concatenate(
        [starts[decode]] + [np.arange(starts[r], starts[r] + q_lens[r]) for r in prefill]
    )
    if (concat_rows == np.arange(len(concat_rows))).all():
        return ReferencePlan(groups, None)
    row_order = np.empty_like(concat_rows)
    row_order[concat_rows] = np.arange(len(concat_rows))
    return ReferencePlan(groups, mx.array(row_order))


def _decode_group(meta: AttentionMetadata, requests: np.ndarray,
                  window: int | None) -> AttentionGroup:
    seq_lens = meta.seq_lens[requests]
    num_blocks = -(-int(seq_lens.max()) // meta.block_size)
    num_keys = num_blocks * meta.block_size
    keys = np.arange(num_keys)[None, :]
    mask = keys < seq_lens[:, None]
    if window is not None:
        mask &= keys >= seq_lens[:, None] - window
    return AttentionGroup(
        rows=mx.array(meta.cu_seqlens_q[requests]),
        tables=mx.array(meta.block_tables[requests, :num_blocks]),
        num_keys=num_keys,
        mask=mx.array(mask[:, None, None, None, :]),
        is_decode=True,
    )


def _prefill_group(meta: AttentionMetadata, r: int, window: int | None) -> AttentionGroup:
    start, end = int(meta.cu_seqlens_q[r]), int(meta.cu_seqlens_q[r + 1])
    seq_len = int(meta.seq_lens[r])
    q_pos = np.arange(seq_len - (end - start), seq_len)[:, None]
    keys = np.arange(seq_len)[None, :]
    mask = keys <= (q_pos if meta.last_keys is None else meta.last_keys[start:end, None])
    if window is not None:
        mask &= keys > q_pos - window
    return AttentionGroup(
        rows=slice(start, end),
        tables=mx.array(meta.block_tables[r : r + 1, : -(-seq_len // meta.block_size)]),
        num_keys=seq_len,
        mask=mx.array(mask[None, None, None]),
        is_decode=False,
    )


def apply_rope(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """Rotate the first `2 * cos.shape[-1]` features of `x [total_q, heads, head_dim]` by
    tables `[total_q, 1, half]` (float32: the products run in float32)."""
    half = cos.shape[-1]
    x1, x2 = x[..., :half], x[..., half:2 * half]
    parts = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
    if 2 * half < x.shape[-1]:
        parts.append(x[..., 2 * half:])
    return mx.concatenate(parts, axis=-1).astype(x.dtype)
