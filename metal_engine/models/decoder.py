"""The decoder stack and causal-LM head every family builds on.

A family's `Model` passes its layers and norm class; this module embeds the packed tokens,
builds each step's rope tables once (one set per distinct rope, e.g. Gemma 3's local and
global), runs the layers and computes logits for the rows that need them.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from kernels_metal.attention import AttentionMetadata
from kernels_metal.cpu_math import linear, tanh_softcap
from metal_engine.kv_cache import KVCache
from metal_engine.model_config import ModelConfig
from metal_engine.models.host import HostPlan, HostStack, to_device, to_host
from metal_engine.models.layers import Linear, RMSNorm
from metal_engine.models.rope import LayerRopes

# Source checkpoints may hold these; they are derived from the config, not parameters here.
DERIVED_WEIGHTS = ("rotary_emb.inv_freq",)


class DecoderModel(nn.Module):
    """Embedding, decoder layers and final norm (the `model.*` weights)."""

    def __init__(self, cfg: ModelConfig, layers: list[nn.Module], norm: type[nn.Module],
                 embed_scale: float | None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = layers
        self.norm = norm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self._embed_scale = embed_scale  # Gemma: sqrt(hidden_size)
        self._ropes = LayerRopes(cfg)
        self._pools = [cfg.cache_index(i) for i in range(cfg.num_hidden_layers)]
        self.host_plan = HostPlan()
        self.host_stack = HostStack()

    def __call__(self, input_ids: mx.array, positions: mx.array, meta: AttentionMetadata,
                 cache: KVCache) -> mx.array:
        h = self.embed(input_ids)
        h = self.run_layers(h, positions, meta, cache, range(len(self.layers)))
        return self.norm(h)

    def run_layers(self, h: mx.array, positions: mx.array, meta: AttentionMetadata,
                   cache: KVCache, layers: range) -> mx.array:
        """Layers `layers` over hidden states `h` (a pipeline stage runs its own), each on
        the host or on MLX as the host plan says, all in one call where the host stack can
        take them (models/host.py)."""
        modules, pools = self.layers, self._pools
        on_host = self.host_plan.layers_on_host(modules, cache)
        tables = _StepRopes(self._ropes, positions, meta)
        if all(on_host[i] for i in layers):
            h = to_host(h)
            stacked = self.host_stack.step(
                h, [modules[i] for i in layers], [pools[i] for i in layers],
                [tables.of_layer(i, True) for i in layers], meta, cache)
            if stacked is not None:
                return to_device(stacked)
        for i in layers:
            h = to_host(h) if on_host[i] else to_device(h)
            h = modules[i](h, tables.of_layer(i, on_host[i]), meta, cache, pools[i])
        return to_device(h)

    def embed(self, input_ids: mx.array) -> mx.array:
        h = self.embed_tokens(input_ids)
        if self._embed_scale is not None:
            h = h * mx.array(self._embed_scale, dtype=h.dtype)  # rounded as transformers does
        return h


class _StepRopes:
    """One step's rope tables, built for MLX layers and for host ones as they are asked for."""

    def __init__(self, ropes: LayerRopes, positions: mx.array, meta: AttentionMetadata) -> None:
        self._ropes, self._positions, self._meta = ropes, positions, meta
        self._tables: dict[bool, list] = {}

    def of_layer(self, layer: int, on_host: bool) -> tuple:
        if on_host not in self._tables:
            positions = to_host(self._positions) if on_host else self._positions
            self._tables[on_host] = self._ropes.tables(positions, self._meta)
        return self._tables[on_host][layer]


class CausalLM(nn.Module):
    """`__call__` gives final hidden states for every packed row; `logits` only for chosen rows."""

    decoder_class: type[DecoderModel] = DecoderModel
    # The family's multi-token-prediction head (`mtp.*` weights), if it has one.
    mtp_class: type[nn.Module] | None = None

    def __init__(self, cfg: ModelConfig, layers: list[nn.Module],
                 norm: type[nn.Module] = RMSNorm, embed_scale: float | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.model = self.decoder_class(cfg, layers, norm, embed_scale)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def __call__(self, input_ids: mx.array, positions: mx.array, meta: AttentionMetadata,
                 cache: KVCache) -> mx.array:
        return self.model(input_ids, positions, meta, cache)

    def logits(self, hidden: mx.array) -> mx.array:
        embed = self.model.embed_tokens
        if not self.config.tie_word_embeddings:
            logits = self.lm_head(hidden)
        elif isinstance(embed, nn.QuantizedEmbedding):  # its weight is packed
            logits = embed.as_linear(hidden)
        else:
            logits = linear(hidden, embed.weight)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else tanh_softcap(logits, cap)

    def update(self, parameters: dict, strict: bool = True) -> CausalLM:
        self.model.host_plan.forget()  # new parameters may be of another dtype
        return super().update(parameters, strict)

    def update_modules(self, modules: dict, strict: bool = True) -> CausalLM:
        self.model.host_plan.forget()  # e.g. quantized layers in place of float ones
        return super().update_modules(modules, strict)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Drop source tensors that are not parameters here (a tied head has no weight)."""
        dropped = DERIVED_WEIGHTS + (("lm_head.",) if self.config.tie_word_embeddings else ())
        return {k: v for k, v in weights.items() if not any(d in k for d in dropped)}
