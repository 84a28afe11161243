"""Linear-attention layers' per-request state, in slots: per layer a conv state
`[slots, kernel - 1, conv_dim]` and a recurrent state `[slots, Hv, Dk, Dv]` (float32).

The runner gives each live request a slot (`bind`, every step) and frees it when the request
finishes (`release`). A request fed from position 0 starts from zeros, so a preempted
request that is recomputed starts over; nothing here survives a prefix-cache hit, which is
why hybrid models serve without prefix caching for now. Like the KV pools, a layer `take`s
its pair and `put`s it back, so the scatter can write in place.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from metal_engine.models.linear_attention_config import GatedDeltaNetConfig


class RecurrentStates:
    def __init__(self, cfg: GatedDeltaNetConfig, num_layers: int, num_slots: int,
                 dtype: mx.Dtype) -> None:
        self.cfg, self.dtype = cfg, dtype
        self.conv: list[mx.array | None] = []
        self.recurrent: list[mx.array | None] = []
        for _ in range(num_layers):
            conv, recurrent = self._zeros(num_slots)
            self.conv.append(conv)
            self.recurrent.append(recurrent)
        self.num_slots = num_slots
        self._slot_of: dict[str, int] = {}
        self._free = list(range(num_slots))
        self.step_slots = mx.zeros((0,), mx.int32)  # the step's requests' slots, in order
        self.step_keep = mx.zeros((0,), mx.float32)  # 0 for a request fed from position 0
        mx.eval(self.conv, self.recurrent)

    @staticmethod
    def bytes_per_slot(cfg: GatedDeltaNetConfig, num_layers: int, dtype: mx.Dtype) -> int:
        conv = (cfg.conv_kernel_size - 1) * cfg.conv_dim * dtype.size
        recurrent = cfg.num_value_heads * cfg.key_head_dim * cfg.value_head_dim * 4
        return num_layers * (conv + recurrent)

    def bind(self, request_ids: Sequence[str], start_positions: Sequence[int]) -> None:
        """The step's requests, in row order: each gets (or keeps) a slot."""
        slots = [self._slot(r) for r in request_ids]
        self.step_slots = mx.array(np.array(slots, np.int32))
        self.step_keep = mx.array(np.array([p > 0 for p in start_positions], np.float32))

    def release(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            slot = self._slot_of.pop(request_id, None)
            if slot is not None:
                self._free.append(slot)

    def take(self, index: int) -> tuple[mx.array, mx.array]:
        conv, recurrent = self.conv[index], self.recurrent[index]
        self.conv[index] = self.recurrent[index] = None
        if conv is None or recurrent is None:
            raise RuntimeError(f"state pool {index} was taken and not put back")
        return conv, recurrent

    def put(self, index: int, conv: mx.array, recurrent: mx.array) -> None:
        self.conv[index], self.recurrent[index] = conv, recurrent

    def arrays(self) -> list[mx.array]:
        return [a for a in self.conv + self.recurrent if a is not None]

    def _slot(self, request_id: str) -> int:
        slot = self._slot_of.get(request_id)
        if slot is None:
            if not self._free:
                self._grow()
            slot = self._free.pop(0)
            self._slot_of[request_id] = slot
        return slot

    def _grow(self) -> None:
        """More requests are live than slots (preempted ones keep theirs): double them."""
        extra = max(self.num_slots, 1)
        conv, recurrent = self._zeros(extra)
        self.conv = [mx.concatenate([c, conv]) for c in self.conv]
        self.recurrent = [mx.concatenate([r, recurrent]) for r in self.recurrent]
        self._free.extend(range(self.num_slots, self.num_slots + extra))
        self.num_slots += extra

    def _zeros(self, slots: int) -> tuple[mx.array, mx.array]:
        cfg = self.cfg
        conv = mx.zeros((slots, cfg.conv_kernel_size - 1, cfg.conv_dim), self.dtype)
        shape = (slots, cfg.num_value_heads, cfg.key_head_dim, cfg.value_head_dim)
        return conv, mx.zeros(shape, mx.float32)
