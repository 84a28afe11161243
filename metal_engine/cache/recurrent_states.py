"""Linear-attention layers' state, in slots: per layer a conv state
`[slots, kernel - 1, conv_dim]` and a recurrent state `[slots, Hv, Dk, Dv]` (float32).

The scheduler hands out the slots (scheduler.cache_groups.recurrent_state): each running
request computes in its live slot, and checkpoints are copies of a live slot at a block
boundary. The runner
`bind`s the step's rows to their requests' slots and `copy`s slots as the step's state plan
says. A request fed from position 0 starts from zeros (a recomputed request starts over).
Like the KV pools, a layer `take`s its pair and `put`s it back, so the scatter can write in
place.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from metal_engine.cache.pool_bytes import RAW_BITS
from metal_engine.kv_disk.store import StateLayout
from metal_engine.models.linear_attention_config import GatedDeltaNetConfig
from scheduler.output import ScheduledRequest


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
        self.step_slots = mx.zeros((0,), mx.int32)  # the step's requests' slots, in order
        self.step_keep = mx.zeros((0,), mx.float32)  # 0 for a request fed from position 0
        mx.eval(self.conv, self.recurrent)

    @staticmethod
    def bytes_per_slot(cfg: GatedDeltaNetConfig, num_layers: int, dtype: mx.Dtype) -> int:
        conv = (cfg.conv_kernel_size - 1) * cfg.conv_dim * dtype.size
        recurrent = cfg.num_value_heads * cfg.key_head_dim * cfg.value_head_dim * 4
        return num_layers * (conv + recurrent)

    def bind(self, scheduled: Sequence[ScheduledRequest]) -> None:
        """The step's requests' slots (their "states" cache group's id) and whether each
        continues a state (starts past position 0), in row order."""
        # From plain lists: numpy arrays in between cost each step more than their work.
        self.step_slots = mx.array([s.group_ids["states"][0] for s in scheduled], mx.int32)
        self.step_keep = mx.array([float(s.start_position > 0) for s in scheduled],
                                  mx.float32)

    def copy(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy slot `source` into slot `target` of every layer, for each (source, target)."""
        if not pairs:
            return
        pairs = np.array(pairs, np.int32)
        source, target = mx.array(pairs[:, 0]), mx.array(pairs[:, 1])
        for index in range(len(self.conv)):
            conv, recurrent = self.take(index)
            conv[target] = conv[source]
            recurrent[target] = recurrent[source]
            self.put(index, conv, recurrent)

    def layout(self) -> StateLayout:
        """What `read_slots` gives per slot, as the disk tier describes it."""
        cfg = self.cfg
        return StateLayout(len(self.conv), (cfg.conv_kernel_size - 1) * cfg.conv_dim,
                           cfg.num_value_heads * cfg.key_head_dim * cfg.value_head_dim,
                           str(self.dtype).removeprefix("mlx.core."))

    def read_slots(self, slots: list[int]) -> list[bytes]:
        """Each slot's conv then recurrent state of every layer, as raw bytes (waits for
        pending writes); the disk tier's checkpoint payloads."""
        index = mx.array(slots)
        parts = [np.asarray(pool[index].reshape(len(slots), -1).view(RAW_BITS[pool.dtype.size][0]))
                 .view(np.uint8) for layer in zip(self.conv, self.recurrent, strict=True)
                 for pool in layer]  # fmt: skip
        raw = np.concatenate(parts, axis=1)
        return [raw[i].tobytes() for i in range(len(slots))]

    def write_slots(self, slots: list[int], payloads: list[bytes]) -> None:
        """Overwrite slots with contents `read_slots` gave, in place, with the next step."""
        n, cfg = len(slots), self.cfg
        raw = np.frombuffer(b"".join(payloads), np.uint8).reshape(n, -1)
        shapes = ((cfg.conv_kernel_size - 1, cfg.conv_dim),
                  (cfg.num_value_heads, cfg.key_head_dim, cfg.value_head_dim))
        index, offset = mx.array(slots), 0
        for layer in range(len(self.conv)):
            conv, recurrent = self.take(layer)
            pools = []
            for pool, shape in zip((conv, recurrent), shapes, strict=True):
                size = int(np.prod(shape)) * pool.dtype.size
                bits = raw[:, offset : offset + size].copy().view(RAW_BITS[pool.dtype.size][1])
                pool[index] = mx.array(bits.reshape(n, *shape)).view(pool.dtype)
                pools.append(pool)
                offset += size
            self.put(layer, *pools)

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

    def _zeros(self, slots: int) -> tuple[mx.array, mx.array]:
        cfg = self.cfg
        conv = mx.zeros((slots, cfg.conv_kernel_size - 1, cfg.conv_dim), self.dtype)
        shape = (slots, cfg.num_value_heads, cfg.key_head_dim, cfg.value_head_dim)
        return conv, mx.zeros(shape, mx.float32)
