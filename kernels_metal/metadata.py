"""Packed-batch attention metadata shared by every attention backend.

A step packs the query tokens of all requests back to back:

    rows:          | req0: 5 prefill rows | req1: 1 decode row | req2: 3 rows |
    cu_seqlens_q:  0                      5                    6              9
    seq_lens:      [5, 40, 19]   context length of each request *after* this step

Row `t` of request `r` sits at position `seq_lens[r] - (cu_seqlens_q[r+1] - t)` and attends
to positions `0..that` of request `r` only. Token at position `p` lives in KV slot
`block_tables[r, p // block_size] * block_size + p % block_size`.

A vision-language model whose image tokens see each other in prefill (Gemma 3 and 4) extends
that limit per row: `last_keys[t]` is the last position row `t` sees, the end of its image
for a row inside one (the chunk holds the image whole), its own position otherwise:

    positions:  5 6 [7 8 9] 10        (an image at 7..9)
    last_keys:  5 6  9 9 9  10        (a window still counts back from the row's position)
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property

import mlx.core as mx
import numpy as np

# Up to this many rows, a step's slots reach the device from plain ints (`device`).
FEW_ROWS = 64


@dataclass(frozen=True)
class AttentionMetadata:
    cu_seqlens_q: np.ndarray  # [num_reqs + 1] int32
    seq_lens: np.ndarray  # [num_reqs] int32
    block_tables: np.ndarray  # [num_reqs, max_blocks] int32, padded with 0
    slot_mapping: np.ndarray  # [total_q] int64
    block_size: int
    # Per-step work a backend derives once and reuses in every layer, keyed by backend.
    backend_plans: dict = field(default_factory=dict, compare=False, repr=False)
    # The same rows through the blocks of a sliding-window group, whose windowed layers keep
    # pools of their own (metal_engine.cache.cache_plan); None: every layer uses these blocks.
    windowed: AttentionMetadata | None = field(default=None, compare=False, repr=False)
    # [total_q] int64: each row's last visible key position, past its own inside an image
    # (see above); None for every step without images that see themselves.
    last_keys: np.ndarray | None = field(default=None, compare=False, repr=False)

    def for_window(self, window: int | None) -> AttentionMetadata:
        """The metadata a layer with this window attends through."""
        return self.windowed if window is not None and self.windowed is not None else self

    def with_last_keys(self, last_keys: np.ndarray | None) -> AttentionMetadata:
        """The same rows (and windowed rows) with `last_keys` (None: plain causal), with
        plans of their own."""
        if last_keys is None and self.last_keys is None:
            return self
        windowed = None if self.windowed is None else self.windowed.with_last_keys(last_keys)
        return replace(self, backend_plans={}, windowed=windowed, last_keys=last_keys)

    @cached_property
    def causal(self) -> AttentionMetadata:
        """These rows, each seeing up to its own position (a layer without the extension)."""
        return self.with_last_keys(None)

    @property
    def num_requests(self) -> int:
        return len(self.seq_lens)

    def rows_of(self, requests: np.ndarray) -> np.ndarray:
        """The packed rows of `requests` (ascending request ids), in order."""
        starts, q_lens = self.cu_seqlens_q[requests], np.diff(self.cu_seqlens_q)[requests]
        firsts = np.cumsum(q_lens) - q_lens  # where each request's rows start among them
        return np.repeat(starts.astype(np.int64) - firsts, q_lens) + np.arange(q_lens.sum())

    def of_requests(self, requests: np.ndarray) -> AttentionMetadata:
        """The metadata of `requests` (ascending request ids) alone, their rows packed back
        to back as `rows_of` lists them; no window group."""
        q_lens = np.diff(self.cu_seqlens_q)[requests]
        cu_seqlens_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(self.cu_seqlens_q.dtype)
        return AttentionMetadata(cu_seqlens_q, self.seq_lens[requests],
                                 self.block_tables[requests],
                                 self.slot_mapping[self.rows_of(requests)], self.block_size)

    @cached_property
    def positions(self) -> np.ndarray:
        """`[total_q]` int64: each row's position in its request (see the module docstring)."""
        q_lens = np.diff(self.cu_seqlens_q)
        ends = np.repeat(self.cu_seqlens_q[1:].astype(np.int64), q_lens)
        return np.repeat(self.seq_lens.astype(np.int64), q_lens) - (ends - np.arange(len(ends)))

    @cached_property
    def device(self) -> DeviceMetadata:
        """The KV writes' slots on the device, built once per step and shared by all layers.
        A few rows' (a decode step's) from plain ints: numpy's divmod and casts cost a step
        more there, each a cold path of numpy by the time the next step comes."""
        if len(self.slot_mapping) <= FEW_ROWS:
            slots, size = self.slot_mapping.tolist(), self.block_size
            return DeviceMetadata(slot_block=mx.array([s // size for s in slots], mx.int32),
                                  slot_offset=mx.array([s % size for s in slots], mx.int32))
        block, offset = np.divmod(self.slot_mapping, self.block_size)
        return DeviceMetadata(slot_block=mx.array(block.astype(np.int32)),
                              slot_offset=mx.array(offset.astype(np.int32)))


@dataclass(frozen=True)
class DeviceMetadata:
    slot_block: mx.array  # [total_q] block id of each new token's slot
    slot_offset: mx.array  # [total_q] offset inside that block
