"""The cache groups a model's layers need, one class a kind (see group.CacheGroup):

    full_attention    "blocks"  a KV block per block of tokens: the anchor of prefix hits,
                                every model has it (or its latent form)
    latent            "latent"  MLA's anchor: the same blocks, each token one latent row
    sliding_window    "window"  windowed layers' blocks, only those the window still sees
    recurrent_state   "states"  a live slot per running request, checkpoints at boundaries
    encoder_cache     "encoder" the vision tower's outputs by image, and its budget per step
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from scheduler.cache_groups.encoder_cache import EncoderCacheGroup
from scheduler.cache_groups.full_attention import FullAttentionGroup
from scheduler.cache_groups.group import CacheGroup
from scheduler.cache_groups.latent import LatentGroup
from scheduler.cache_groups.recurrent_state import RecurrentStateGroup
from scheduler.cache_groups.sliding_window import SlidingWindowGroup
from scheduler.config import SchedulerConfig
from scheduler.kv_connector import KVConnectorScheduler

if TYPE_CHECKING:
    from scheduler.prefix_hash import BlockHash

__all__ = ["CacheGroup", "FullAttentionGroup", "anchor_for", "groups_for"]

# The groups that keep every token's blocks, by the kind SchedulerConfig.kv_kind names.
_ANCHORS: dict[str, type[FullAttentionGroup]] = {
    group.kind: group for group in (FullAttentionGroup, LatentGroup)}


def anchor_for(config: SchedulerConfig, connector: KVConnectorScheduler | None = None,
               on_evict: Callable[[BlockHash], None] | None = None) -> FullAttentionGroup:
    """The anchor group of `config`'s kind (see FullAttentionGroup for `connector`,
    `on_evict`)."""
    return _ANCHORS[config.kv_kind](config.num_blocks, config.block_size, connector, on_evict)


def groups_for(config: SchedulerConfig,
               connector: KVConnectorScheduler | None = None) -> list[CacheGroup]:
    """The groups beside the anchor that `config` sizes. `connector`: the KV tier's, past memory, if
    any, which keeps their evicted data too."""
    groups: list[CacheGroup] = []
    if config.num_window_blocks:
        groups.append(SlidingWindowGroup(config.num_window_blocks, config.block_size,
                                         config.window, connector))
    if config.num_state_slots:
        interval = config.state_checkpoint_interval if config.enable_prefix_caching else None
        groups.append(RecurrentStateGroup(config.num_state_slots, config.block_size, interval,
                                          connector))
    if config.encoder_cache_rows:  # last: its cut may stretch a chunk to an image's end
        groups.append(EncoderCacheGroup(config.encoder_cache_rows,
                                        config.encoder_step_rows or config.encoder_cache_rows,
                                        config.whole_images))
    return groups
