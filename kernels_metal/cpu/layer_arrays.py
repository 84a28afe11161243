"""What a pre-norm decoder layer's compiled host steps take (cpu_layer.LayerArrays): numpy
views of its parameters and of its loaded LoRA adapters' stacks, gathered once and again only
when one was replaced or the adapters were restacked."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from kernels_metal.cpu import layer as cpu_layer
from kernels_metal.cpu.low_rank import NO_PAIR, host_pair


def step_arrays(layer: nn.Module, lora_version: int) -> cpu_layer.LayerArrays | None:
    """The layer's arrays, or None: it has no compiled host step (only a plain pre-norm layer
    of a plain attention, its q/k norms RMSNorms if any, and a SwiGLU MLP has).
    `lora_version`: the adapters' (`AdapterSlots.version`), which changes as they restack."""
    held = getattr(layer, "_host_step_arrays", None)
    if held is None:
        held = _HeldArrays(_has_step(layer))
        layer._host_step_arrays = held
    return held(layer, lora_version) if held.has_step else None


def _has_step(layer: nn.Module) -> bool:
    plain = getattr(type(layer), "is_plain", None)  # models.layers.PreNormDecoderLayer's
    return plain is not None and plain(layer)


class _HeldArrays:
    """A layer's arrays, gathered again when a parameter or module in it was replaced (new
    weights, q/k/v packed anew, a new linear): gathering them cost ~35 us a layer at every
    step, checking them ~3."""

    def __init__(self, has_step: bool) -> None:
        self.has_step = has_step
        self._sources: tuple[tuple[nn.Module, str, mx.array | nn.Module], ...] = ()
        self._arrays: cpu_layer.LayerArrays | None = None
        self._lora_version = 0

    def __call__(self, layer: nn.Module, lora_version: int) -> cpu_layer.LayerArrays:
        for module, key, held in self._sources:
            if module.get(key) is not held:
                break
        else:
            if self._arrays is not None and lora_version == self._lora_version:
                return self._arrays
        self._arrays = _gather(layer)  # packs first: q/k/v become views
        self._lora_version = lora_version
        self._sources = tuple((module, key, value) for module in layer.modules()
                              for key, value in module.items()
                              if isinstance(value, (mx.array, nn.Module)))
        return self._arrays


def _gather(layer: nn.Module) -> cpu_layer.LayerArrays:
    attention, mlp = layer.self_attn, layer.mlp
    qk_norms = None
    if "q_norm" in attention:
        qk_norms = (np.asarray(attention.q_norm.weight), np.asarray(attention.k_norm.weight),
                    attention.q_norm.eps)
    return cpu_layer.LayerArrays(
        input_norm=(np.asarray(layer.input_layernorm.weight), layer.input_layernorm.eps),
        qkv=views(attention.qkv()), qk_norms=qk_norms,
        shape=(attention.num_heads, attention.num_kv_heads, attention.head_dim),
        o=views(attention.o_proj),
        post_norm=(np.asarray(layer.post_attention_layernorm.weight),
                   layer.post_attention_layernorm.eps),
        gate_up=views(mlp.gate_up()), down=views(mlp.down_proj),
        attention=(attention.scale, attention.softcap, attention.window, "sinks" in attention),
        lora=tuple(_lora_pair(module.get(name)) for module, names in (
            (attention, cpu_layer.ATTENTION_LORA), (mlp, cpu_layer.MLP_LORA)) for name in names))


def _lora_pair(linear: nn.Module | None) -> tuple[np.ndarray, np.ndarray]:
    """The adapters' stacks on `linear` (metal_engine.lora.slots.LoraWeights) as
    cpu_low_rank's products take them, or NO_PAIRs (none targets it; a fused q/k/v or
    gate/up linear, which no adapter targets)."""
    lora = None if linear is None else linear.lora
    if lora is None:
        return NO_PAIR, NO_PAIR
    return host_pair(np.asarray(lora.a), np.asarray(lora.b))


def views(layer) -> tuple[np.ndarray, np.ndarray | None]:
    """Numpy views of a linear's (or packed linears') weight and bias, made again when either
    was replaced: viewing an MLX array costs ~2.5 us, a few hundred times a step."""
    weight, bias = layer.get("weight"), layer.get("bias")  # packs packed linears first
    held = getattr(layer, "_host_views", None)
    if held is None or held[0] is not weight or held[1] is not bias:
        held = (weight, bias, np.asarray(weight), None if bias is None else np.asarray(bias))
        # A plain attribute, not a parameter: nn.Module keeps tuples as children.
        object.__setattr__(layer, "_host_views", held)
    return held[2], held[3]
