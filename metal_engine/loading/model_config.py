"""The model's shape and architecture options: read from, and written back to, config.json.

One ModelConfig covers every supported family; fields a family lacks keep their neutral
default (no bias, no window, no soft-capping). Keys are Hugging Face's, so a converted model
dir stays loadable by transformers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from metal_engine.loading import families
from metal_engine.loading.families import (
    ACTIVATIONS,
    ARCHITECTURES,
    GEMMA,
    HYBRID,
    MLA,
    QWEN,
    REQUIRED_KEYS,
    ROPE_PER_LAYER_TYPE,
    SUPPORTED_MODEL_TYPES,
    LayerType,
    OutputGate,
)
from metal_engine.loading.text_part import text_part_config
from metal_engine.models import gemma4_config
from metal_engine.models.dsa_config import DSA, IndexerConfig
from metal_engine.models.encoder_config import (
    ENCODER_ACTIVATIONS,
    ENCODERS,
    EncoderOptions,
    read_encoder,
)
from metal_engine.models.gemma4_config import Gemma4Options, read_gemma4
from metal_engine.models.linear_attention_config import GatedDeltaNetConfig
from metal_engine.models.mla_config import MlaConfig
from metal_engine.models.moe_config import MoeConfig, read_moe
from metal_engine.models.muse_glimmer_config import MuseGlimmerOptions, read_muse_glimmer
from metal_engine.models.rope_parameters import RopeParameters

if TYPE_CHECKING:
    from scheduler.config import KVKind


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope: RopeParameters = field(default_factory=RopeParameters)
    local_rope: RopeParameters | None = None  # sliding layers' own rope (Gemma 3)
    hidden_act: str = "silu"
    attention_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None  # keys a sliding layer sees, its own included
    layer_types: tuple[LayerType, ...] = ()  # empty: every layer full attention
    query_pre_attn_scalar: float | None = None  # attention scale**-2 when not head_dim
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # (kv_heads, head_dim) of each layer where they differ by layer (Gemma 4); empty: the
    # fields above for every layer.
    layer_kv_shapes: tuple[tuple[int, int], ...] = ()
    kv_shared_layers: int = 0  # the last layers read K/V an earlier layer wrote (Gemma 4)
    # Query heads of each layer where they differ by layer (Laguna); empty: num_attention_heads.
    layer_heads: tuple[int, ...] = ()
    # Attention output gated by a projection of the layer's input, one value per head or per
    # feature (Laguna, Muse Glimmer); None: not gated.
    output_gate: OutputGate | None = None
    qk_norm: bool = False  # an RMSNorm over each head of q and k where the family makes it optional
    moe: MoeConfig | None = None  # None: every layer has a dense MLP
    gemma4: Gemma4Options | None = None
    muse_glimmer: MuseGlimmerOptions | None = None
    # Linear-attention layers' shape (Qwen3.5); None: the model has none.
    linear_attention: GatedDeltaNetConfig | None = None
    # Multi-head latent attention's shape; None: the model's attention keeps K and V per head.
    mla: MlaConfig | None = None
    # DeepSeek sparse attention's indexer (on MLA); None: every query sees its whole context.
    indexer: IndexerConfig | None = None
    # A bidirectional encoder's options (BERT, XLM-RoBERTa); None: a causal decoder.
    encoder: EncoderOptions | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {self.model_type!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.layer_heads and len(self.layer_heads) != self.num_hidden_layers:
            raise ValueError(f"num_attention_heads_per_layer lists {len(self.layer_heads)} "
                             f"layers, the model has {self.num_hidden_layers}")
        for heads in {self.num_attention_heads, *self.layer_heads}:
            if heads % self.num_key_value_heads:
                raise ValueError(
                    f"num_attention_heads ({heads}) must be a multiple of "
                    f"num_key_value_heads ({self.num_key_value_heads})"
                )
        for rope in (self.rope, self.local_rope or self.rope):
            if int(self.head_dim * rope.partial_rotary_factor) % 2:
                raise ValueError(f"the rotated part of head_dim {self.head_dim} must be even")
        activations = ACTIVATIONS if self.encoder is None else ENCODER_ACTIVATIONS
        if self.hidden_act not in activations:
            raise ValueError(f"activation {self.hidden_act!r} is not supported; supported: "
                             f"{', '.join(activations)}")
        if self.layer_types and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types lists {len(self.layer_types)} layers, the model has "
                             f"{self.num_hidden_layers}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1, got {self.sliding_window}")

    @property
    def trained_context_len(self) -> int:
        """The longest context the model is meant for: max_position_embeddings, or what YaRN
        stretches the original length to (Qwen's recipe adds rope_scaling to an unchanged
        max_position_embeddings). The other rope kinds already count in max_position_embeddings.
        An encoder's learned positions end there, counted from its first position's row."""
        if self.encoder is not None:
            return self.max_position_embeddings - self.encoder.position_offset
        rope = self.rope
        if rope.rope_type == "yarn" and rope.factor and rope.original_max_position_embeddings:
            stretched = int(rope.original_max_position_embeddings * rope.factor)
            return max(self.max_position_embeddings, stretched)
        return self.max_position_embeddings

    def layer_type(self, layer: int) -> LayerType:
        return self.layer_types[layer] if self.layer_types else "full_attention"

    def attention_heads(self, layer: int) -> int:
        """Query heads of layer `layer`."""
        return self.layer_heads[layer] if self.layer_heads else self.num_attention_heads

    def window(self, layer: int) -> int | None:
        """Keys layer `layer` attends to (its own included); None: the whole context."""
        return self.sliding_window if self.layer_type(layer) == "sliding_attention" else None

    @property
    def kv_kind(self) -> KVKind:
        """The cache group that keeps every token's K/V (scheduler.cache_groups): with MLA its
        latent rows ("latent"), else K and V blocks ("blocks")."""
        return "latent" if self.mla is not None else "blocks"

    def kv_shape(self, layer: int) -> tuple[int, int]:
        """(kv_heads, head_dim) of layer `layer`: with MLA one latent row per token, its keys
        only (the values are a part of it), and after it an indexing layer's index key."""
        if self.mla is not None:
            indexed = self.indexer is not None and self.indexer.indexes(layer)
            return 1, self.mla.latent_width + (self.indexer.head_dim if indexed else 0)
        if self.layer_kv_shapes:
            return self.layer_kv_shapes[layer]
        return self.num_key_value_heads, self.head_dim

    def rope_head_dim(self, layer: int) -> int:
        """The features of a head that layer `layer`'s rope sees (part of them may rotate):
        its head_dim (with MLA, what the rope's share is of: `families.mla_head_dim`)."""
        return self.head_dim if self.mla is not None else self.kv_shape(layer)[1]

    def kv_pool(self, layer: int) -> int:
        """The KV pool attention layer `layer` attends over: its own, or for a layer sharing
        K/V the pool of the last layer of its type before the sharing ones (transformers'
        rule). Pools are numbered over the layers that own one."""
        first_shared = self.num_hidden_layers - self.kv_shared_layers
        source = layer
        if layer >= first_shared:
            kind = self.layer_type(layer)
            source = max(i for i in range(first_shared) if self.layer_type(i) == kind)
        return self._kv_owners().index(source)

    def kv_pool_shapes(self) -> list[tuple[int, int]]:
        """(kv_heads, head_dim) of each KV pool, in pool order."""
        return [self.kv_shape(i) for i in self._kv_owners()]

    def windowed_pools(self) -> list[int]:
        """The KV pools of sliding-window layers, if the model also has full-attention ones
        (a group of their own: see metal_engine.cache.cache_plan); else none."""
        kinds = [self.layer_type(owner) for owner in self._kv_owners()]
        if "full_attention" not in kinds or self.sliding_window is None:
            return []
        return [pool for pool, kind in enumerate(kinds) if kind == "sliding_attention"]

    def state_layers(self) -> list[int]:
        """The linear-attention layers: each keeps a recurrent state per request."""
        return [i for i in range(self.num_hidden_layers)
                if self.layer_type(i) == "linear_attention"]

    def cache_index(self, layer: int) -> int:
        """Where layer `layer` keeps its cache: its KV pool, or for a linear-attention layer
        its place among the state layers."""
        if self.layer_type(layer) == "linear_attention":
            return self.state_layers().index(layer)
        return self.kv_pool(layer)

    def _kv_owners(self) -> list[int]:
        first_shared = self.num_hidden_layers - self.kv_shared_layers
        return [i for i in range(first_shared) if self.layer_type(i) != "linear_attention"]

    def rope_for(self, layer_type: LayerType) -> RopeParameters:
        if layer_type == "sliding_attention" and self.local_rope is not None:
            return self.local_rope
        return self.rope

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Read a Hugging Face config.json (transformers 4 or 5 style)."""
        cfg = _checked_text_config(cfg)
        model_type = cfg["model_type"]
        heads = cfg["num_attention_heads"]
        window = families.sliding_window(cfg)
        rope, local_rope = families.ropes(cfg)
        layer_types = families.layer_types(cfg, window)
        gemma4 = model_type == "gemma4_text"
        mla = MlaConfig.from_hf(cfg) if model_type in MLA else None
        if model_type in DSA:  # their latent attention pairs its rope dims, whatever it says
            mla = replace(mla, rope_interleave=True)
        encoder = read_encoder(cfg) if model_type in ENCODERS else None
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=(families.mla_head_dim(mla, rope) if mla is not None
                      else cfg.get("head_dim") or cfg["hidden_size"] // heads),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            # An encoder's checkpoint may say tied (its masked-LM head's), but it has no LM head.
            tie_word_embeddings=encoder is None and bool(cfg.get("tie_word_embeddings", False)),
            rope=rope,
            local_rope=local_rope,
            hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu",
            attention_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            sliding_window=window,
            layer_types=layer_types,
            layer_kv_shapes=gemma4_config.layer_kv_shapes(cfg, layer_types) if gemma4 else (),
            kv_shared_layers=cfg.get("num_kv_shared_layers") or 0,
            layer_heads=families.layer_heads(cfg),
            output_gate=families.output_gate(cfg),
            gemma4=read_gemma4(cfg) if gemma4 else None,
            muse_glimmer=(read_muse_glimmer(cfg, rope.rope_theta)
                          if model_type == "muse_glimmer_text" else None),
            linear_attention=(GatedDeltaNetConfig.from_hf(cfg)
                              if "linear_attention" in layer_types else None),
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar") if model_type in GEMMA else None,
            attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
            final_logit_softcapping=cfg.get("final_logit_softcapping"),
            qk_norm=bool(cfg.get("use_qk_norm", False)) if model_type == "glm4_moe" else False,
            moe=read_moe(cfg),
            mla=mla,
            indexer=IndexerConfig.from_hf(cfg) if model_type in DSA else None,
            encoder=encoder,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_as_tuple(cfg.get("eos_token_id")),
        )

    @classmethod
    def from_model_dir(cls, model_dir: Path) -> ModelConfig:
        return cls.from_dict(read_config_json(model_dir))

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json keys that define this model, readable by transformers 4 and 5."""
        eos = list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0]
        config: dict[str, Any] = {
            "model_type": self.model_type,
            "architectures": [ARCHITECTURES[self.model_type]],
            **{k: getattr(self, k) for k in (
                "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
                "max_position_embeddings", "tie_word_embeddings", "attention_bias",
                "bos_token_id")},
            "eos_token_id": eos if self.eos_token_ids else None,
            "hidden_activation" if self.model_type in (*GEMMA, "muse_glimmer_text")
            else "hidden_act": self.hidden_act,
        }
        if self.model_type == "llama":
            config["mlp_bias"] = self.mlp_bias
        elif self.model_type not in ("glm4_moe", *MLA):
            config["sliding_window"] = self.sliding_window
        if self.model_type == "glm4_moe":
            config["use_qk_norm"] = self.qk_norm
        if self.moe is not None:
            config.update(self.moe.to_hf(self.model_type))
        if self.model_type in ("glm4_moe_lite", "laguna", *DSA):  # dense layers by kind
            config["mlp_layer_types"] = [
                "sparse" if self.moe is not None and self.moe.is_moe_layer(i) else "dense"
                for i in range(self.num_hidden_layers)]
        if self.linear_attention is not None:
            config.update(self.linear_attention.to_hf())
        if self.mla is not None:
            config.update(self.mla.to_hf())
        if self.indexer is not None:
            config.update(self.indexer.to_hf(self.num_hidden_layers))
        if self.encoder is not None:
            config.update(self.encoder.to_hf(self.model_type))
        if self.model_type == "laguna":
            config.update(gating=self.output_gate, num_attention_heads_per_layer=[
                self.attention_heads(i) for i in range(self.num_hidden_layers)])
        if self.muse_glimmer is not None:
            config.update(self.muse_glimmer.to_hf(self.rope.rope_theta, self.num_hidden_layers),
                          final_logit_softcapping=self.final_logit_softcapping)
        if self.model_type in (*QWEN, *GEMMA, *HYBRID, "gpt_oss", "laguna",
                               "muse_glimmer_text"):  # others: from the window
            config["layer_types"] = [self.layer_type(i) for i in range(self.num_hidden_layers)]
        if self.model_type in (*QWEN, "qwen3_moe"):
            config["use_sliding_window"] = self.sliding_window is not None
        if self.gemma4 is not None:
            config.update(self.gemma4.to_hf(), num_kv_shared_layers=self.kv_shared_layers,
                          per_layer_config={str(i): {"num_key_value_heads": h, "head_dim": d}
                                            for i, (h, d) in enumerate(self.layer_kv_shapes)})
        if self.model_type in GEMMA:
            config.update(query_pre_attn_scalar=self.query_pre_attn_scalar,
                          attn_logit_softcapping=self.attn_logit_softcapping,
                          final_logit_softcapping=self.final_logit_softcapping)
        config.update(self._rope_keys())
        return config

    def _rope_keys(self) -> dict[str, Any]:
        # transformers 5 reads only rope_parameters, older tools only rope_theta/rope_scaling.
        full = self.rope.to_hf()
        keys: dict[str, Any] = {"rope_theta": self.rope.rope_theta, "rope_parameters": full}
        # transformers' Gemma 4 config takes a rope_scaling as every layer's rope (replacing the
        # per-layer-type dict, then refusing it: no rope_theta); Gemma 3's as the full layers';
        # Laguna's reads only rope_parameters.
        if self.rope.rope_type != "default" and self.model_type not in ("gemma4_text", "laguna"):
            keys["rope_scaling"] = {k: v for k, v in full.items() if k != "rope_theta"}
        if self.model_type in ROPE_PER_LAYER_TYPE:
            # Each layer type's dict holds its own partial_rotary_factor: a top-level one
            # would be read as every rope's.
            local = self.rope_for("sliding_attention")
            keys["rope_parameters"] = {"full_attention": full, "sliding_attention": local.to_hf()}
            keys["rope_local_base_freq"] = local.rope_theta
        elif self.rope.partial_rotary_factor != 1.0:
            keys["partial_rotary_factor"] = self.rope.partial_rotary_factor
        return keys


# What `metal-serve convert` records of a dir it wrote (its source, dtypes, converter version).
MANIFEST_FILE = "metal_serve_manifest.json"


def read_config_json(model_dir: Path) -> dict[str, Any]:
    """A model dir's config.json as a dict."""
    path = Path(model_dir) / "config.json"
    if not path.exists():
        raise FileNotFoundError(
            f"{path} not found: point at a converted model dir "
            "(make one with `metal-serve convert <source> --out DIR`)"
        )
    return json.loads(path.read_text(encoding="utf-8"))


def _checked_text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The text model's part of a config.json, its family's defaults filled in, refused
    with what to do where it is not a causal LM this engine serves."""
    cfg = text_part_config(cfg)
    model_type = cfg.get("model_type", "llama")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not supported; supported: "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    cfg = {**families.FAMILY_DEFAULTS.get(model_type, {}), **cfg, "model_type": model_type}
    if model_type == "minimax_m2":
        cfg = families.rotary_dim_as_share(cfg)
    missing = [k for k in REQUIRED_KEYS if k not in cfg]
    if missing:
        raise ValueError(f"config.json lacks required keys: {', '.join(missing)}")
    if cfg.get("use_bidirectional_attention") not in (None, False, "vision"):
        raise ValueError("bidirectional (embedding) Gemma models are not causal LMs; "
                         "use a checkpoint with use_bidirectional_attention false")
    return cfg


def _as_tuple(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (value,)
