"""Scheduler limits, fixed when the engine starts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from scheduler.spec_decode.config import SpeculativeConfig

SchedulingPolicy = Literal["fcfs", "priority"]
# The anchor group's kind (scheduler.cache_groups): K and V blocks, or MLA's latent rows.
KVKind = Literal["blocks", "latent"]


@dataclass(frozen=True)
class SchedulerConfig:
    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048
    enable_prefix_caching: bool = True
    # What keeps every token's K/V: "blocks" (a FullAttentionGroup), or for multi-head latent
    # attention "latent" (a LatentGroup: the same blocks, one latent row per token).
    kv_kind: KVKind = "blocks"
    # fcfs: arrival order. priority: lower `Request.priority` first, arrival order among equals.
    scheduling_policy: SchedulingPolicy = "fcfs"
    # Hybrid models (recurrent state per request): state slots, for running requests and
    # prefix-cache checkpoints together (0: the model keeps no such state), and the blocks
    # between a long prompt's checkpoints.
    num_state_slots: int = 0
    state_checkpoint_interval: int = 32
    # Sliding-window layers beside full ones: their blocks (0: no such group) and window.
    num_window_blocks: int = 0
    window: int | None = None
    # Speculative decoding: how decoding requests draft tokens that the step verifies.
    speculative: SpeculativeConfig | None = None
    # A model that reads images: the embedding rows its encoder cache holds and the rows the
    # tower encodes in one step (0: as many as the cache holds); 0 rows: no such model.
    encoder_cache_rows: int = 0
    encoder_step_rows: int = 0
    # A text model whose image tokens see each other in prefill: no chunk ends inside an image.
    whole_images: bool = False
    # A bidirectional encoder: each prompt is computed whole in one step (its tokens see each
    # other), or waits for a step with room; the token budget must hold max_model_len.
    whole_prompts: bool = False

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.num_state_slots and self.num_state_slots < self.max_num_seqs:
            raise ValueError(f"num_state_slots must be at least max_num_seqs "
                             f"({self.max_num_seqs}), got {self.num_state_slots}")
        if self.num_window_blocks:
            self._check_window_group()
        if self.state_checkpoint_interval < 1:
            raise ValueError("state_checkpoint_interval must be at least 1, got "
                             f"{self.state_checkpoint_interval}")
        if self.whole_images and not self.encoder_cache_rows:
            raise ValueError("whole_images is the encoder cache group's rule: give the model "
                             "encoder_cache_rows")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.whole_prompts and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"whole prompts need a token budget of at least max_model_len "
                             f"({self.max_model_len}), got {self.max_num_batched_tokens}")
        if self.kv_kind not in get_args(KVKind):
            raise ValueError(f"kv_kind must be one of {', '.join(get_args(KVKind))}, got "
                             f"{self.kv_kind!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(
                f"scheduling_policy must be fcfs or priority, got {self.scheduling_policy!r}"
            )

    def _check_window_group(self) -> None:
        """The group must hold one request's window and a whole step's chunk after it, or
        that request could never be scheduled."""
        if self.window is None or self.window < 1:
            raise ValueError(f"a sliding-window group needs a window of at least 1, got "
                             f"{self.window}")
        chunk = min(self.max_num_batched_tokens, self.max_model_len)
        needed = -(-(self.window - 1 + chunk) // self.block_size) + 2  # + misalignment, null
        if self.num_window_blocks < needed:
            raise ValueError(f"a sliding-window group of {self.num_window_blocks} blocks cannot "
                             f"hold a window of {self.window} and a {chunk}-token step "
                             f"({needed} blocks): give it more blocks or a smaller token budget")
