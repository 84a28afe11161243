"""What only Gemma 4's text model has, read from its config (the `text_config` of a multimodal
checkpoint, or a `gemma4_text` config.json) and written back."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# What transformers assumes for keys a Gemma 4 config.json leaves out.
DEFAULTS: dict[str, Any] = {
    "head_dim": 256, "sliding_window": 512, "hidden_activation": "gelu_pytorch_tanh",
    "tie_word_embeddings": True, "hidden_size_per_layer_input": 256,
    "vocab_size_per_layer_input": 262_144, "sliding_window_pattern": 6,
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                           "rope_theta": 1_000_000.0},
    },
}  # fmt: skip
GLOBAL_HEAD_DIM = 512  # full-attention layers' head size when the config does not list them


@dataclass(frozen=True)
class Gemma4Options:
    """`per_layer_input_size` > 0: each layer adds a gated projection of its own slice of a
    per-layer embedding (PLE). `values_are_keys`: full-attention layers have no v_proj and
    attend over their keys as values. `double_wide_mlp`: layers that share K/V have an MLP
    twice as wide."""

    per_layer_input_size: int = 0
    per_layer_vocab_size: int = 0
    values_are_keys: bool = False
    double_wide_mlp: bool = False
    pad_token_id: int = 0  # what image rows' per-layer embeddings look up (config.json's)

    def to_hf(self) -> dict[str, Any]:
        return {"hidden_size_per_layer_input": self.per_layer_input_size,
                "vocab_size_per_layer_input": self.per_layer_vocab_size,
                "attention_k_eq_v": self.values_are_keys,
                "use_double_wide_mlp": self.double_wide_mlp}  # fmt: skip


def read_gemma4(cfg: dict[str, Any]) -> Gemma4Options:
    return Gemma4Options(
        per_layer_input_size=cfg.get("hidden_size_per_layer_input") or 0,
        per_layer_vocab_size=cfg.get("vocab_size_per_layer_input") or 0,
        values_are_keys=bool(cfg.get("attention_k_eq_v", False)),
        double_wide_mlp=bool(cfg.get("use_double_wide_mlp", False)),
        pad_token_id=cfg.get("pad_token_id") or 0,
    )


def layer_kv_shapes(cfg: dict[str, Any],
                    layer_types: tuple[str, ...]) -> tuple[tuple[int, int], ...]:
    """(kv_heads, head_dim) per layer: the config's `per_layer_config` overrides, or the
    transformers rule for configs without it (full layers get `global_head_dim`, and with
    shared keys and values `num_global_key_value_heads`)."""
    base = (cfg.get("num_key_value_heads") or cfg["num_attention_heads"], cfg["head_dim"])
    overrides = cfg.get("per_layer_config")
    if overrides is None:
        full = {"head_dim": cfg.get("global_head_dim", GLOBAL_HEAD_DIM)}
        if cfg.get("attention_k_eq_v") and cfg.get("num_global_key_value_heads"):
            full["num_key_value_heads"] = cfg["num_global_key_value_heads"]
        overrides = {str(i): full for i, kind in enumerate(layer_types)
                     if kind == "full_attention"}
    shapes = []
    for layer in range(cfg["num_hidden_layers"]):
        own = overrides.get(str(layer)) or {}
        shapes.append((own.get("num_key_value_heads", base[0]), own.get("head_dim", base[1])))
    return tuple(shapes)
