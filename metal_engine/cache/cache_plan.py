"""How the cache budget is split between the model's cache groups, once at startup.

    full attention   KV pools of every block a request holds: the bulk of the budget
    sliding window   KV pools of windowed layers beside full ones (Gemma 2/3/4, GPT-OSS): a
                     request holds only the blocks its window still sees, so the group gets
                     enough for every request that can run at once, and no more
    recurrent state  state slots of linear-attention layers (Qwen3.5): one live slot per
                     request that can run at once, plus checkpoints for the prefix cache

Models whose every attention layer slides (Mistral's window) keep their whole context: there is
no full group to give the memory to.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import mlx.core as mx

from kernels_metal.kv_quant import KVQuant
from metal_engine.cache.pool_bytes import bytes_per_block
from metal_engine.cache.recurrent_states import RecurrentStates
from metal_engine.loading.model_config import ModelConfig

# Checkpoints for prefix hits take at most this share of the cache budget, and at most two
# per request that can run at once (a conversation's end and its prompt's).
CHECKPOINT_SHARE = 0.25
CHECKPOINTS_PER_SEQ = 2


@dataclass(frozen=True)
class CachePlan:
    num_blocks: int  # blocks of the full-attention pools (of every pool without a window group)
    bytes_per_block: int
    windowed_pools: tuple[int, ...] = ()  # pools of the sliding-window group
    window: int | None = None
    num_window_blocks: int = 0
    bytes_per_window_block: int = 0
    num_state_slots: int = 0
    bytes_per_state_slot: int = 0


@dataclass(frozen=True)
class GroupBytes:
    """What the model's cache groups cost (see scheduler.cache_groups): a block of the
    full-attention pools, and each other group's ids, sized by the requests that can run at
    once rather than by tokens."""

    bytes_per_block: int  # of the pools that keep every token
    window_blocks: int = 0  # the sliding-window group's blocks
    bytes_per_window_block: int = 0
    live_state_slots: int = 0  # one recurrent state per running request
    bytes_per_state_slot: int = 0

    @property
    def fixed_bytes(self) -> int:
        """What the groups beside the full pools take whatever the context."""
        return (self.window_blocks * self.bytes_per_window_block
                + self.live_state_slots * self.bytes_per_state_slot)


def group_bytes(cfg: ModelConfig, dtype: mx.Dtype, block_size: int, max_num_seqs: int,
                max_num_batched_tokens: int, quant: KVQuant | None = None) -> GroupBytes:
    """`cfg`'s cache groups' bytes (K/V stored as `dtype`, or as `quant`'s codes and scales;
    recurrent states stay `dtype`)."""
    shapes, windowed = cfg.kv_pool_shapes(), cfg.windowed_pools()
    full = bytes_per_block([s for i, s in enumerate(shapes) if i not in windowed],
                           block_size, dtype, quant, cfg.kv_kind)  # fmt: skip
    groups = GroupBytes(full)
    if windowed:
        window = bytes_per_block([shapes[i] for i in windowed], block_size, dtype, quant,
                                 "window")
        groups = replace(
            groups, bytes_per_window_block=window,
            window_blocks=window_blocks(cfg.sliding_window, block_size, max_num_seqs,
                                        max_num_batched_tokens))  # fmt: skip
    if cfg.linear_attention is not None:
        groups = replace(groups, live_state_slots=max_num_seqs,
                         bytes_per_state_slot=RecurrentStates.bytes_per_slot(
                             cfg.linear_attention, len(cfg.state_layers()), dtype))
    return groups


def plan_cache(cfg: ModelConfig, budget: int, dtype: mx.Dtype, block_size: int,
               max_num_seqs: int, max_num_batched_tokens: int,
               prefix_caching: bool, quant: KVQuant | None = None) -> CachePlan:
    """Split `budget` bytes between the groups `cfg`'s layers need (K/V stored as `dtype`,
    or as `quant`'s codes and scales; recurrent states stay `dtype`)."""
    groups = group_bytes(cfg, dtype, block_size, max_num_seqs, max_num_batched_tokens, quant)
    state = {}
    if groups.live_state_slots:
        slot_bytes = groups.bytes_per_state_slot
        num_slots = groups.live_state_slots
        if prefix_caching:
            num_slots += min(CHECKPOINTS_PER_SEQ * max_num_seqs,
                             int(budget * CHECKPOINT_SHARE) // slot_bytes)
        state = dict(num_state_slots=num_slots, bytes_per_state_slot=slot_bytes)
        budget -= num_slots * slot_bytes
    full, window_bytes = groups.bytes_per_block, groups.bytes_per_window_block
    all_bytes = full + window_bytes
    num_window = groups.window_blocks
    if num_window and num_window < max(budget, 0) // all_bytes:  # else the split saves nothing
        return CachePlan(max(budget - num_window * window_bytes, 0) // full, full,
                         tuple(cfg.windowed_pools()), cfg.sliding_window, num_window,
                         window_bytes, **state)  # fmt: skip
    return CachePlan(max(budget, 0) // all_bytes, all_bytes, **state)


def window_blocks(window: int, block_size: int, max_num_seqs: int,
                  max_num_batched_tokens: int) -> int:
    """Blocks a sliding-window group needs at most: each running request's window (and the
    block it is filling), plus the keys of a step's new tokens, plus the null block freed
    entries point to."""
    per_request = -(-(window - 1) // block_size) + 2
    return max_num_seqs * per_request + -(-max_num_batched_tokens // block_size) + 1
