"""The anchor cache group of multi-head latent attention (DeepSeek V3's family): a block per
`block_size` tokens, every token kept, as full attention keeps them.

What differs is what a block holds, which the runner lays out by this group's kind: per token
and layer one latent row (`kv_lora_rank` compressed values, then `qk_rope_head_dim` rope key),
one "head" of keys whose first values are the values too, so no V pools
(metal_engine.cache.pool_bytes.holds_values). Its blocks are shared, hit, evicted, saved to
the tier and freed as full attention's.
"""

from __future__ import annotations

from scheduler.cache_groups.full_attention import FullAttentionGroup


class LatentGroup(FullAttentionGroup):
    kind = "latent"
