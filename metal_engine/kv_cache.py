"""Paged K/V pools, one pair per pool, each `[num_blocks, block_size, kv_heads, head_dim]`.

A pool usually belongs to one layer; a model whose layers differ in KV heads or head size
(Gemma 4's full and sliding layers) gives each pool its own shape, and one whose layers share
K/V (Gemma 4's last layers) has fewer pools than layers (see ModelConfig.kv_pool). The pools
of a sliding-window group (metal_engine.cache_plan) have blocks of their own, fewer of them.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from kernels_metal.kv_quant import KVQuant

if TYPE_CHECKING:
    from metal_engine.cache_plan import CachePlan
    from metal_engine.model_config import ModelConfig
    from metal_engine.recurrent_states import RecurrentStates

PoolShape = tuple[int, int]  # (kv_heads, head_dim)

log = logging.getLogger(__name__)

# Off Apple Silicon the pool comes out of system RAM: take a modest share of what is free.
HOST_MEMORY_FRACTION = 0.25
HOST_MEMORY_CAP = 4 << 30
DEVICE_MEMORY_FRACTION = 0.6


class KVCache:
    """Owns the pools. Layers `take` a pair, scatter into it and `put` it back.

    Taking leaves no other reference behind, so MLX can donate the pool's buffer to the scatter
    and write in place instead of copying the pool every step. The writes are only built here;
    the runner evaluates them once no queued work still reads the pools.
    """

    def __init__(self, shapes: Sequence[PoolShape], num_blocks: int, block_size: int,
                 dtype: mx.Dtype, windowed: Sequence[int] = (), num_window_blocks: int = 0):
        """`shapes`: (kv_heads, head_dim) of each pool; the `windowed` ones (a sliding-window
        group) hold `num_window_blocks` blocks, the others `num_blocks`."""
        self.shapes, self.windowed = tuple(shapes), tuple(windowed)
        self.num_blocks, self.block_size = num_blocks, block_size
        sizes = [num_window_blocks if i in self.windowed else num_blocks
                 for i in range(len(self.shapes))]
        self.k: list[mx.array | None] = [mx.zeros((n, block_size, *shape), dtype)
                                         for n, shape in zip(sizes, self.shapes, strict=True)]
        self.v: list[mx.array | None] = [mx.zeros((n, block_size, *shape), dtype)
                                         for n, shape in zip(sizes, self.shapes, strict=True)]
        mx.eval(self.k, self.v)

    states: RecurrentStates | None = None  # linear-attention layers' (see recurrent_states)

    @classmethod
    def for_model(cls, cfg: ModelConfig, plan: CachePlan, block_size: int,
                  dtype: mx.Dtype) -> KVCache:
        """The pools and state slots `cfg`'s layers need, sized as `plan` says."""
        cache = cls(cfg.kv_pool_shapes(), plan.num_blocks, block_size, dtype,
                    plan.windowed_pools, plan.num_window_blocks)
        if cfg.linear_attention is not None:
            from metal_engine.recurrent_states import RecurrentStates

            cache.states = RecurrentStates(cfg.linear_attention, len(cfg.state_layers()),
                                           plan.num_state_slots, dtype)
        return cache

    def peek(self, layer: int) -> tuple[mx.array, mx.array]:
        """A pool pair to read without writing (a layer reading another layer's K/V)."""
        k, v = self.k[layer], self.v[layer]
        if k is None or v is None:
            raise RuntimeError(f"KV pool of layer {layer} was taken and not put back")
        return k, v

    def take(self, layer: int) -> tuple[mx.array, mx.array]:
        k, v = self.k[layer], self.v[layer]
        self.k[layer] = self.v[layer] = None
        if k is None or v is None:
            raise RuntimeError(f"KV pool of layer {layer} was taken and not put back")
        return k, v

    def put(self, layer: int, k: mx.array, v: mx.array) -> None:
        self.k[layer], self.v[layer] = k, v

    def arrays(self) -> list[mx.array]:
        arrays = [a for a in self.k + self.v if a is not None]
        return arrays if self.states is None else arrays + self.states.arrays()

    @property
    def dtype(self) -> mx.Dtype:
        return self.k[0].dtype

    def read_blocks(self, block_ids: list[int], windowed: bool = False) -> list[bytes]:
        """Each block's K then V of every pool of its group (the full pools, or `windowed`
        the sliding-window group's), as raw bytes (waits for pending writes)."""
        pools = self._group(windowed)
        index = mx.array(block_ids)
        # [n, features of every pool]; bit-cast so numpy takes any dtype
        blocks = mx.concatenate([kv[i][index].reshape(len(block_ids), -1)
                                 for kv in (self.k, self.v) for i in pools], axis=1)
        raw = np.asarray(blocks.view(RAW_BITS[self.dtype.size][0]))
        return [raw[i].tobytes() for i in range(len(block_ids))]

    def write_blocks(self, block_ids: list[int], payloads: list[bytes],
                     windowed: bool = False) -> None:
        """Overwrite blocks with contents `read_blocks` gave, in place, with the next step."""
        pools, n = self._group(windowed), len(block_ids)
        raw = np.frombuffer(b"".join(payloads), RAW_BITS[self.dtype.size][1]).reshape(n, -1)
        blocks = mx.array(raw).view(self.dtype)
        sizes = [self.block_size * heads * dim for heads, dim in self.group_shapes(windowed)] * 2
        parts = mx.split(blocks, list(itertools.accumulate(sizes))[:-1], axis=1)
        index = mx.array(block_ids)
        for part, pool in enumerate(pools):
            shape = self.shapes[pool]
            k, v = self.take(pool)
            k[index] = parts[part].reshape(n, self.block_size, *shape)
            v[index] = parts[len(pools) + part].reshape(n, self.block_size, *shape)
            self.put(pool, k, v)

    def group_shapes(self, windowed: bool = False) -> list[PoolShape]:
        """(kv_heads, head_dim) of the pools of one group, in pool order."""
        return [self.shapes[i] for i in self._group(windowed)]

    def _group(self, windowed: bool) -> list[int]:
        return [i for i in range(len(self.shapes)) if (i in self.windowed) == windowed]


# Unsigned ints of each element size (MLX, numpy): blocks travel as raw bits.
RAW_BITS = {4: (mx.uint32, np.uint32), 2: (mx.uint16, np.uint16)}


def bytes_per_block(shapes: Sequence[PoolShape], block_size: int, dtype: mx.Dtype,
                    quant: KVQuant | None = None) -> int:
    """K and V of one block of every pool: `dtype` elements, or `quant`'s codes and scales."""
    if quant is not None:
        return 2 * block_size * sum(heads * quant.bytes_per_row(dim) for heads, dim in shapes)
    return 2 * block_size * sum(heads * dim for heads, dim in shapes) * dtype.size


def default_kv_cache_memory(weights_bytes: int) -> int:
    """Bytes for the pools when the user did not say: what the device can spare."""
    if mx.metal.is_available():
        info = mx.device_info()
        budget = info.get("max_recommended_working_set_size", info["memory_size"])
        return max(int(budget * DEVICE_MEMORY_FRACTION) - weights_bytes, 64 << 20)
    return min(int(_available_host_memory() * HOST_MEMORY_FRACTION), HOST_MEMORY_CAP)


def _available_host_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
