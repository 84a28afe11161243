"""The one attention entry point the models call; picks a backend per device.

Metal kernels plug in here; until one is available for the running device and shape, the
pure-MLX reference serves every call.
"""

from __future__ import annotations

import mlx.core as mx

from kernels_metal.metadata import AttentionMetadata
from kernels_metal.reference import paged_attention_reference, write_kv

__all__ = ["AttentionMetadata", "paged_attention", "write_kv"]


def paged_attention(
    q: mx.array, k_pool: mx.array, v_pool: mx.array, meta: AttentionMetadata, scale: float
) -> mx.array:
    """Packed varlen causal attention: `q [total_q, H, D]` -> `[total_q, H, D]`.

    `k_pool`/`v_pool` are `[num_blocks, block_size, kv_heads, head_dim]`; query heads
    `h` use KV head `h // (H // kv_heads)` (GQA).
    """
    return paged_attention_reference(q, k_pool, v_pool, meta, scale)
