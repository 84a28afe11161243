"""The Llama checkpoint layout every source is converted to: config keys, tensor names, shapes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from metal_engine.model_config import SUPPORTED_MODEL_TYPES, read_rope_theta

# Source checkpoints may carry these; they are derived from the config, so they are dropped.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class LlamaSpec:
    """The shape-defining hyperparameters; field names are the Hugging Face config keys."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")


def spec_from_hf_config(config: dict[str, Any]) -> LlamaSpec:
    """Read a Hugging Face config.json (transformers 4 or 5 style) into a LlamaSpec."""
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model_type {model_type!r} is not supported; the converter handles Llama-layout "
            f"models ({', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    if config.get("quantization_config") or config.get("quantization"):
        raise ValueError("quantized checkpoints are not supported; convert the float checkpoint")
    _check_sliding_window(config)
    missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads", "vocab_size") if k not in config]
    if missing:
        raise ValueError(f"config.json lacks required keys: {', '.join(missing)}")
    heads = config["num_attention_heads"]
    eos = config.get("eos_token_id")
    return LlamaSpec(
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_hidden_layers=config["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        vocab_size=config["vocab_size"],
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=read_rope_theta(config),
        max_position_embeddings=config.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        bos_token_id=config.get("bos_token_id"),
        eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
        attention_bias=bool(config.get("attention_bias", False)),
        mlp_bias=bool(config.get("mlp_bias", False)),
        hidden_act=config.get("hidden_act", "silu"),
    )


def _check_sliding_window(config: dict[str, Any]) -> None:
    # Llama attends to the whole context; a Mistral window shorter than it changes the math.
    window = config.get("sliding_window")
    if config.get("model_type") == "mistral" and window and window < config.get(
        "max_position_embeddings", 0
    ):
        raise ValueError(
            f"this Mistral checkpoint uses sliding-window attention (window {window}), which the "
            "Llama layout cannot express; use a checkpoint with sliding_window null"
        )


def config_dict(spec: LlamaSpec, dtype: str, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """The config.json to write: `base` (the source config, if any) plus every explicit key."""
    config = dict(base or {})
    fields = dataclasses.asdict(spec)
    if isinstance(spec.eos_token_id, tuple):
        fields["eos_token_id"] = list(spec.eos_token_id)
    config.update(fields)
    config.update(_rope_keys(config, spec.rope_theta))
    config.update(model_type="llama", architectures=["LlamaForCausalLM"])
    config["torch_dtype"] = config["dtype"] = dtype
    return config


def _rope_keys(base: dict[str, Any], theta: float) -> dict[str, Any]:
    # transformers 5 reads only rope_parameters, older tools only rope_theta/rope_scaling.
    params = dict(base.get("rope_parameters") or base.get("rope_scaling") or {})
    rope_type = params.pop("type", None) or params.get("rope_type") or "default"
    params.update(rope_type=rope_type, rope_theta=theta)
    keys: dict[str, Any] = {"rope_theta": theta, "rope_parameters": params}
    if rope_type != "default":
        keys["rope_scaling"] = {k: v for k, v in params.items() if k != "rope_theta"}
    return keys


def tensor_shapes(spec: LlamaSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor the model dir holds, in writing order, with its [out, in] shape."""
    hidden, vocab = spec.hidden_size, spec.vocab_size
    q_rows = spec.num_attention_heads * spec.head_dim
    kv_rows = spec.num_key_value_heads * spec.head_dim
    linears = {
        "self_attn.q_proj": (q_rows, hidden, spec.attention_bias),
        "self_attn.k_proj": (kv_rows, hidden, spec.attention_bias),
        "self_attn.v_proj": (kv_rows, hidden, spec.attention_bias),
        "self_attn.o_proj": (hidden, q_rows, spec.attention_bias),
        "mlp.gate_proj": (spec.intermediate_size, hidden, spec.mlp_bias),
        "mlp.up_proj": (spec.intermediate_size, hidden, spec.mlp_bias),
        "mlp.down_proj": (hidden, spec.intermediate_size, spec.mlp_bias),
    }
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(spec.num_hidden_layers):
        prefix = f"model.layers.{i}."
        shapes[prefix + "input_layernorm.weight"] = (hidden,)
        for name, (rows, cols, bias) in linears.items():
            shapes[prefix + name + ".weight"] = (rows, cols)
            if bias:
                shapes[prefix + name + ".bias"] = (rows,)
        shapes[prefix + "post_attention_layernorm.weight"] = (hidden,)
    shapes["model.norm.weight"] = (hidden,)
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def check_tensors(found: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]]) -> None:
    """Raise ValueError unless `found` has exactly the expected names and shapes."""
    missing = [n for n in expected if n not in found]
    extra = [n for n in found if n not in expected]
    if missing or extra:
        raise ValueError(
            "the checkpoint does not match the Llama layout its config describes: "
            f"missing {_few(missing)}, unexpected {_few(extra)}"
        )
    wrong = [f"{n} {tuple(found[n])} (expected {expected[n]})"
             for n in expected if tuple(found[n]) != expected[n]]
    if wrong:
        raise ValueError(f"tensor shapes do not match the config: {_few(wrong)}")


def _few(names: list[str], limit: int = 4) -> str:
    if not names:
        return "none"
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
