"""The host forward: on MLX's CPU backend, layers run on numpy arrays.

There every op a layer calls ends in numpy anyway (kernels_metal.cpu_math, cpu_attention),
so each MLX op between two of them only added an evaluation and a copy each way: ~500 of
them a decode step, half as long as the weight products themselves. A layer whose modules
all take numpy arrays (`HOST_ARRAYS` on their class), whose parameters are all float32 and
whose K/V pools hold float32 or float16 runs on the host instead: its K/V are written into
the pool's buffer in place and its output stays numpy for the next layer.

Every other layer (quantized weights or K/V, kinds with no host form such as MoE or linear
attention) runs on MLX as it does on Metal; the hidden state crosses between the two only
where consecutive layers differ. The plan is made once per K/V storage and forgotten when
the model's parameters change (`CausalLM.update`).
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from kernels_metal.attention import numpy_serves
from metal_engine.kv_cache import KVCache

HOST_POOL_DTYPES = (mx.float32, mx.float16)


def to_host(x: mx.array | np.ndarray) -> np.ndarray:
    """`x` as a numpy array (an MLX one is evaluated and viewed, not copied)."""
    return x if isinstance(x, np.ndarray) else np.asarray(x)


def to_device(x: mx.array | np.ndarray) -> mx.array:
    return mx.array(x) if isinstance(x, np.ndarray) else x


def takes_host_arrays(module: nn.Module) -> bool:
    """Whether `module` and everything in it run on numpy float32 arrays."""
    if not all(getattr(type(m), "HOST_ARRAYS", False) for m in module.modules()):
        return False
    return all(p.dtype == mx.float32 for _, p in tree_flatten(module.parameters()))


class HostPlan:
    """Which of a model's layers run on the host, per K/V storage (`KVCache.storage`)."""

    def __init__(self) -> None:
        self._by_storage: dict[str, list[bool]] = {}

    def layers_on_host(self, layers: Sequence[nn.Module], cache: KVCache) -> list[bool]:
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
