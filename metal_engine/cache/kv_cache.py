"""Paged K/V pools, one pair per pool, each `[num_blocks, block_size, kv_heads, head_dim]`.

A pool usually belongs to one layer; a model whose layers differ in KV heads or head size
(Gemma 4's full and sliding layers) gives each pool its own shape, and one whose layers share
K/V (Gemma 4's last layers) has fewer pools than layers (see ModelConfig.kv_pool). Each pool
belongs to one cache group, by the scheduler's kind (scheduler.cache_groups): "blocks" holds
every token, a sliding-window group's pools ("window", metal_engine.cache.cache_plan) have
blocks of their own, fewer of them; a hybrid model's recurrent states are the "states" group.
An MLA model's "latent" pools hold every token too, as one key row each, whose first values
are its values (models/mla.py): no V pools (pool_bytes.holds_values says which kinds keep V).
With `--kv-cache-dtype int8|int4` each pool is a QuantizedPool (codes and scales, see
kernels_metal.kv_quant), which the layers take, write and read as they do an array.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence
from functools import partial
from typing import TYPE_CHECKING, NamedTuple

import mlx.core as mx
import numpy as np

from kernels_metal.kv_quant import KVQuant, QuantizedPool, empty_pool
from metal_engine.cache.pool_bytes import RAW_BITS, bytes_per_block, holds_values
from metal_engine.kv_disk.store import BlockLayout, Layout
from scheduler.output import CacheKind

if TYPE_CHECKING:
    from metal_engine.cache.cache_plan import CachePlan
    from metal_engine.cache.recurrent_states import RecurrentStates
    from metal_engine.loading.model_config import ModelConfig

PoolShape = tuple[int, int]  # (kv_heads, head_dim)
Pool = mx.array | QuantizedPool


class GroupData(NamedTuple):
    """One cache group's data as the disk tier moves it: what an id's payload holds, and
    how payloads leave and enter memory by id."""

    layout: Layout
    read: Callable[[list[int]], list[bytes]]
    write: Callable[[list[int], list[bytes]], None]

log = logging.getLogger(__name__)


class KVCache:
    """Owns the pools. Layers `take` a pair, scatter into it and `put` it back.

    Taking leaves no other reference behind, so MLX can donate the pool's buffer to the scatter
    and write in place instead of copying the pool every step. The writes are only built here;
    the runner evaluates them once no queued work still reads the pools.
    """

    def __init__(self, shapes: Sequence[PoolShape], num_blocks: int, block_size: int,
                 dtype: mx.Dtype, windowed: Sequence[int] = (), num_window_blocks: int = 0,
                 quant: KVQuant | None = None, held: Collection[int] | None = None,
                 kind: CacheKind = "blocks"):
        """`shapes`: (kv_heads, head_dim) of each pool; the `windowed` ones (a sliding-window
        group) hold `num_window_blocks` blocks, the others, of group `kind` (the anchor:
        "blocks", or MLA's "latent", which has no V pools: `take` gives None for them),
        `num_blocks`. `dtype`: the model's; the pools store it, or `quant`'s codes and
        scales. `held`: the pools this process's layers use (a pipeline stage's); the others
        hold no blocks."""
        self.shapes, self.kind = tuple(shapes), kind
        self.num_blocks, self.block_size = num_blocks, block_size
        self.model_dtype, self.quant = dtype, quant
        full = tuple(i for i in range(len(self.shapes)) if i not in windowed)
        # Each group's pools, in pool order; a group without pools is left out.
        self.pool_groups: dict[CacheKind, tuple[int, ...]] = {
            group: pools for group, pools in ((kind, full), ("window", tuple(windowed)))
            if pools}  # fmt: skip
        self.pool_kinds = [kind if i in full else "window"  # each pool's group
                           for i in range(len(self.shapes))]
        sizes = [0 if held is not None and i not in held
                 else num_window_blocks if i in windowed else num_blocks
                 for i in range(len(self.shapes))]
        pools = list(zip(sizes, self.shapes, self.pool_kinds, strict=True))
        self.k: list[Pool | None] = [self._empty(n, shape, group, keys=True)
                                     for n, shape, group in pools]
        self.v: list[Pool | None] = [
            self._empty(n, shape, group, keys=False) if holds_values(group) else None
            for n, shape, group in pools]
        mx.eval(self.arrays())

    def _empty(self, num_blocks: int, shape: PoolShape, kind: CacheKind, keys: bool) -> Pool:
        if self.quant is None:
            return mx.zeros((num_blocks, self.block_size, *shape), self.model_dtype)
        # Keys are stored turned (kv_quant.rotation), but not latent rows: their values are
        # a part of them.
        rotated = keys and holds_values(kind)
        return empty_pool(num_blocks, self.block_size, *shape, self.quant, rotated=rotated)

    states: RecurrentStates | None = None  # linear-attention layers' (see recurrent_states)
    # What the host forward keeps of the pools between steps (numpy views,
    # kernels_metal/cpu/host_forward.py):
    # views pin their buffers, so they are dropped before a pool is taken or scattered into
    # (MLX then writes in place instead of copying the pool).
    host_views: object | None = None

    @classmethod
    def for_model(cls, cfg: ModelConfig, plan: CachePlan, block_size: int,
                  dtype: mx.Dtype, quant: KVQuant | None = None,
                  held: Collection[int] | None = None) -> KVCache:
        """The pools and state slots `cfg`'s layers need, sized as `plan` says (of the pools,
        only the `held` ones, if given, get blocks)."""
        cache = cls(cfg.kv_pool_shapes(), plan.num_blocks, block_size, dtype,
                    plan.windowed_pools, plan.num_window_blocks, quant, held, cfg.kv_kind)
        if cfg.linear_attention is not None:
            from metal_engine.cache.recurrent_states import RecurrentStates

            cache.states = RecurrentStates(cfg.linear_attention, len(cfg.state_layers()),
                                           plan.num_state_slots, dtype)
        return cache

    def peek(self, layer: int) -> tuple[Pool, Pool]:
        """A pool pair to read without writing (a layer reading another layer's K/V)."""
        k, v = self.k[layer], self.v[layer]
        self._check_present(layer, k, v)
        return k, v

    def take(self, layer: int) -> tuple[Pool, Pool]:
        k, v = self.k[layer], self.v[layer]
        self.k[layer] = self.v[layer] = None
        self._check_present(layer, k, v)
        self.host_views = None  # the taker may write through MLX, which would copy a pinned pool
        return k, v

    def put(self, layer: int, k: Pool, v: Pool) -> None:
        self.k[layer], self.v[layer] = k, v

    def _check_present(self, layer: int, k: Pool | None, v: Pool | None) -> None:
        if k is None or (v is None and holds_values(self.pool_kinds[layer])):
            raise RuntimeError(f"KV pool of layer {layer} was taken and not put back")

    def arrays(self) -> list[mx.array]:
        arrays = [a for pool in self.k + self.v if pool is not None for a in _arrays(pool)]
        return arrays if self.states is None else arrays + self.states.arrays()

    @property
    def storage(self) -> str:
        """What a block's K/V are stored as: the model dtype's name, or int8 / int4."""
        if self.quant is not None:
            return f"int{self.quant.bits}"
        return str(self.model_dtype).removeprefix("mlx.core.")

    def groups(self) -> dict[CacheKind, GroupData]:
        """The data of each cache group this cache holds, by kind: the pools' blocks of the
        anchor ("blocks" or "latent") and "window", the recurrent states' slots."""
        groups = {}
        for kind in self.pool_groups:
            layout = BlockLayout(tuple(self.group_shapes(kind)), self.block_size, self.storage,
                                 values=holds_values(kind))
            groups[kind] = GroupData(layout, partial(self.read_blocks, kind=kind),
                                     partial(self.write_blocks, kind=kind))
        if self.states is not None:
            states = self.states
            groups["states"] = GroupData(states.layout(), states.read_slots, states.write_slots)
        return groups

    def bytes_per_block(self, kind: CacheKind) -> int:
        """One block's K and V (or K only) over the pools of group `kind` (`self.kind`: the
        anchor's)."""
        return bytes_per_block(self.group_shapes(kind), self.block_size, self.model_dtype,
                               self.quant, kind)

    def read_blocks(self, block_ids: list[int], kind: CacheKind) -> list[bytes]:
        """Each block's K then V of every pool of group `kind`, as raw bytes: a quantized
        pool's codes then scales (waits for pending writes)."""
        index, n = mx.array(block_ids), len(block_ids)
        raw = np.concatenate([  # bit-cast so that numpy takes any dtype
            np.asarray(a[index].view(RAW_BITS[a.dtype.size][0])).reshape(n, -1).view(np.uint8)
            for a in self._group_arrays(kind)], axis=1)
        return [raw[i].tobytes() for i in range(n)]

    def write_blocks(self, block_ids: list[int], payloads: list[bytes],
                     kind: CacheKind) -> None:
        """Overwrite blocks with contents `read_blocks` gave, in place, with the next step."""
        self.host_views = None
        n, index = len(block_ids), mx.array(block_ids)
        raw = np.frombuffer(b"".join(payloads), np.uint8).reshape(n, -1)
        offset = 0
        for a in self._group_arrays(kind):  # each scatter updates its pool in place
            size = a[0].nbytes
            bits = np.ascontiguousarray(raw[:, offset : offset + size])
            part = mx.array(bits.view(RAW_BITS[a.dtype.size][1])).view(a.dtype)
            a[index] = part.reshape(n, *a.shape[1:])
            offset += size

    def _group_arrays(self, kind: CacheKind) -> list[mx.array]:
        """The arrays of a group's pools: each K pool's, then each V pool's."""
        pools_of_group = self.pool_groups.get(kind, ())
        return [a for pools in (self.k, self.v) for i in pools_of_group
                if pools[i] is not None for a in _arrays(pools[i])]

    def group_shapes(self, kind: CacheKind) -> list[PoolShape]:
        """(kv_heads, head_dim) of the pools of one group, in pool order."""
        return [self.shapes[i] for i in self.pool_groups.get(kind, ())]


def _arrays(pool: Pool) -> list[mx.array]:
    return pool.arrays() if isinstance(pool, QuantizedPool) else [pool]
