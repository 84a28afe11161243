"""Pure-MLX paged attention and KV write: runs off Metal; every kernel is checked against it."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from kernels_metal.metadata import AttentionMetadata


def write_kv(pool: mx.array, new: mx.array, meta: AttentionMetadata) -> mx.array:
    """Scatter `new [total_q, kv_heads, head_dim]` into `pool` at the step's slots.

    The caller must hold no other reference to `pool`, so MLX donates its buffer and the
    scatter happens in place instead of copying the whole pool.
    """
    dev = meta.device
    pool[dev.slot_block, dev.slot_offset] = new.astype(pool.dtype)
    return pool


def paged_attention_reference(
    q: mx.array, k_pool: mx.array, v_pool: mx.array, meta: AttentionMetadata, scale: float
) -> mx.array:
    """Causal varlen attention of packed queries `[total_q, H, D]` over paged K/V.

    Decode rows of all requests go through one batched call; each prefill chunk gets its own
    call with a causal mask offset by its cached prefix.
    """
    plan = meta.reference_plan
    parts = []
    if len(plan.decode_requests):
        parts.append(_decode_rows(q, k_pool, v_pool, meta, plan.decode_requests, scale))
    for r in plan.prefill_requests:
        parts.append(_prefill_rows(q, k_pool, v_pool, meta, int(r), scale))
    if len(parts) == 1:  # already in packed order
        return parts[0].astype(q.dtype)
    return mx.concatenate(parts, axis=0)[mx.array(plan.row_order)].astype(q.dtype)


def _gather_kv(pool: mx.array, block_ids: np.ndarray) -> mx.array:
    """Blocks `[..., n]` -> `[..., kv_heads, n * block_size, head_dim]`."""
    kv = pool[mx.array(block_ids)]  # [..., n, bs, kvh, d]
    *lead, n, bs, kvh, d = kv.shape
    kv = kv.reshape(*lead, n * bs, kvh, d)
    return mx.swapaxes(kv, -3, -2)


def _decode_rows(q, k_pool, v_pool, meta, requests: np.ndarray, scale: float) -> mx.array:
    seq_lens = meta.seq_lens[requests]
    num_blocks = int(-(-seq_lens.max() // meta.block_size))
    tables = meta.block_tables[requests, :num_blocks]
    k = _gather_kv(k_pool, tables).astype(mx.float32)  # [R, kvh, L, d]
    v = _gather_kv(v_pool, tables).astype(mx.float32)
    rows = mx.array(meta.cu_seqlens_q[requests])
    queries = q[rows].astype(mx.float32)[:, :, None, :]  # [R, H, 1, d]
    key_pos = np.arange(num_blocks * meta.block_size)
    mask = mx.array(key_pos[None, :] < seq_lens[:, None])[:, None, None, :]
    out = mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=mask)
    return out[:, :, 0, :]


def _prefill_rows(q, k_pool, v_pool, meta, r: int, scale: float) -> mx.array:
    start, end = int(meta.cu_seqlens_q[r]), int(meta.cu_seqlens_q[r + 1])
    seq_len = int(meta.seq_lens[r])
    num_blocks = -(-seq_len // meta.block_size)
    table = meta.block_tables[r : r + 1, :num_blocks]
    k = _gather_kv(k_pool, table)[..., :seq_len, :].astype(mx.float32)  # [1, kvh, L, d]
    v = _gather_kv(v_pool, table)[..., :seq_len, :].astype(mx.float32)
    queries = mx.swapaxes(q[start:end].astype(mx.float32), 0, 1)[None]  # [1, H, n, d]
    q_pos = np.arange(seq_len - (end - start), seq_len)
    mask = mx.array(np.arange(seq_len)[None, :] <= q_pos[:, None])
    out = mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=mask)
    return mx.swapaxes(out[0], 0, 1)
