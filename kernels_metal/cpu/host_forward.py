"""The host forward: on MLX's CPU backend, layers run on numpy arrays.

There every op a layer calls ends in numpy anyway (cpu_math, cpu_attention), so each MLX op
between two of them only added an evaluation and a copy each way: ~500 of them a decode step,
half as long as the weight products themselves. A layer whose modules all compute through
their ops alone (`OPS_ONLY` on their class), whose parameters are all float32 and whose K/V
pools hold float32 or float16 runs on the host instead: its K/V are written into the pool's
buffer in place and its output stays numpy for the next layer.

Every other layer (quantized weights or K/V, kinds with no host form such as MoE or linear
attention) runs on MLX as it does on Metal; the hidden state crosses between the two only
where consecutive layers differ. The plan is made once per K/V storage and forgotten when
the model's parameters change (`HostOps.parameters_changed`).

A step with LoRA adapter rows runs its host layers on the host only in their compiled steps
(`HostLora`), which add the adapters' deltas after each targeted product (cpu_low_rank).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from kernels_metal.attention import AttentionMetadata, numpy_serves
from kernels_metal.cpu import attention as cpu_attention
from kernels_metal.cpu import layer as cpu_layer
from kernels_metal.cpu import low_rank as cpu_low_rank
from kernels_metal.cpu.layer_arrays import step_arrays

HOST_POOL_DTYPES = (mx.float32, mx.float16)


def to_host(x: mx.array | np.ndarray) -> np.ndarray:
    """`x` as a numpy array (an MLX one is evaluated and viewed, not copied)."""
    return x if isinstance(x, np.ndarray) else np.asarray(x)


def to_device(x: mx.array | np.ndarray) -> mx.array:
    return mx.array(x) if isinstance(x, np.ndarray) else x


def takes_host_arrays(module: nn.Module) -> bool:
    """Whether `module` and everything in it run on numpy float32 arrays."""
    if not all(getattr(type(m), "OPS_ONLY", False) for m in module.modules()):
        return False
    return all(p.dtype == mx.float32 for _, p in tree_flatten(module.parameters()))


class HostLora(NamedTuple):
    """A step's LoRA adapter rows as the compiled layer steps take them
    (cpu_low_rank.host_rows; NO_ROWS: none this step), and the version of the adapters'
    stacks (metal_engine.lora.slots.AdapterSlots: 0 where none are loaded)."""

    rows: cpu_low_rank.HostRows = cpu_low_rank.NO_ROWS
    version: int = 0

    @classmethod
    def of(cls, adapters) -> HostLora:
        """Of a decoder's `adapters` (None: it serves none) in the step being built."""
        if adapters is None:
            return cls()
        rows = adapters.rows
        if rows is None:
            return cls(version=adapters.version)
        return cls(cpu_low_rank.host_rows(rows.host), adapters.version)

    @property
    def active(self) -> bool:
        return len(self.rows[0]) > 0

    def served_by_steps(self, layers: Sequence[nn.Module], num_rows: int) -> bool:
        """Whether compiled steps (which add the deltas) can run every host layer of
        `layers` for `num_rows` rows: a module-by-module host layer knows no adapters."""
        return all(step_arrays(layer, self.version) is not None for layer in layers)


class HostPlan:
    """Which of a model's layers run on the host, per K/V storage (`KVCache.storage`)."""

    def __init__(self) -> None:
        self._by_storage: dict[str, list[bool]] = {}

    def layers_on_host(self, layers: Sequence[nn.Module], cache) -> list[bool]:
        if not numpy_serves():
            return [False] * len(layers)
        plan = self._by_storage.get(cache.storage)
        if plan is None:
            float_pools = cache.quant is None and cache.model_dtype in HOST_POOL_DTYPES
            plan = [float_pools and takes_host_arrays(layer) for layer in layers]
            self._by_storage[cache.storage] = plan
        return plan

    def forget(self) -> None:
        self._by_storage.clear()


class HostStack:
    """A model's host layers of a few rows in one compiled call (cpu_layer.step_layers) when
    each is a pre-norm layer with a compiled host step and the step's attention is all
    cpu_decode's rows: a decode step then costs little beyond its weight products (the
    default model's step ~3 ms shorter than a layer at a time, ~12%).

    The layers' typed lists are kept while every layer's arrays are the ones they were made
    of; the pools' while the cache keeps them (`KVCache.host_views`)."""

    def __init__(self) -> None:
        self._layers: tuple[cpu_layer.LayerArrays, ...] = ()
        self._stack: cpu_layer.LayerStack | None = None

    def step(self, h: np.ndarray, layers: Sequence[nn.Module], pools: Sequence[int],
             rope: tuple[np.ndarray, np.ndarray] | None, meta: AttentionMetadata,
             cache, lora: HostLora) -> np.ndarray | None:
        """`h` through `layers` (writing pools `pools`, all turned by `rope`: numpy cos, sin
        `[rows, half]`; None if the layers differ; adding `lora`'s rows' deltas), or None
        where they cannot go in one call."""
        float_pools = cache.quant is None and cache.model_dtype == mx.float32
        if not float_pools or rope is None:
            return None
        arrays = tuple(step_arrays(layer, lora.version) for layer in layers)
        if any(a is None or a.attention != arrays[0].attention for a in arrays):
            return None
        scale, softcap, window, sinks = arrays[0].attention
        meta = meta.for_window(window)
        decode = None if sinks else cpu_attention.compiled_rows(meta, arrays[0].shape[0],
                                                                window)
        if decode is None or not self._stack_of(arrays):
            return None
        return cpu_layer.step_layers(h, self._stack, _pool_lists(cache, pools), rope,
                                     meta.slot_mapping, decode, scale, softcap, lora.rows)

    def _stack_of(self, arrays: tuple[cpu_layer.LayerArrays, ...]) -> bool:
        if len(arrays) != len(self._layers) or any(
                a is not b for a, b in zip(arrays, self._layers, strict=False)):
            self._layers = arrays
            self._stack = cpu_layer.LayerStack(arrays) if cpu_layer.LayerStack.takes(
                arrays) else None
        return self._stack is not None


def layer_step(layer: nn.Module, x: np.ndarray, rope: tuple[np.ndarray, np.ndarray], meta,
               cache, pool: int, lora: HostLora) -> np.ndarray | None:
    """A pre-norm layer of host rows in two compiled calls around its attention (cpu_layer),
    or None where it has no such step."""
    arrays = step_arrays(layer, lora.version)
    if arrays is None:
        return None
    q, k, v = cpu_layer.attention_inputs(x, arrays, rope, lora.rows)
    out = layer.self_attn.attend(q, k, v, meta, cache, pool)
    return cpu_layer.after_attention(x, out.reshape(len(x), -1), arrays, lora.rows)


def _pool_lists(cache, pools: Sequence[int]) -> tuple:
    """The pools' numpy views as cpu_layer's lists, kept in the cache between steps."""
    held = cache.host_views
    if held is None or held[0] != tuple(pools):
        views = [tuple(np.asarray(a) for a in cache.peek(p)) for p in pools]
        held = cache.host_views = (tuple(pools), cpu_layer.pool_lists(
            [k for k, _ in views], [v for _, v in views]))
    return held[1]
