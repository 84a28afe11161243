"""What each family's config.json means beyond the common keys: the transformers class that
runs it, what transformers assumes for keys left out, which layers slide or are linear, and
its rope(s). `ModelConfig.from_dict` reads a config through these.
"""

from __future__ import annotations

from typing import Any, Literal

from metal_engine.models import encoder_config, gemma4_config, muse_glimmer_config, qwen3_vl_config
from metal_engine.models.dsa_config import DSA
from metal_engine.models.encoder_config import ENCODER_ARCHITECTURES
from metal_engine.models.mla_config import MlaConfig
from metal_engine.models.rope_parameters import RopeParameters, read_rope, read_rope_theta

# model_type -> the transformers class that runs it (config.json's `architectures`).
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "gemma4_text": "Gemma4ForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "glm4_moe_lite": "Glm4MoeLiteForCausalLM",
    "mistral4": "Mistral4ForCausalLM",
    "deepseek_v32": "DeepseekV32ForCausalLM",
    "glm_moe_dsa": "GlmMoeDsaForCausalLM",
    "minimax_m2": "MiniMaxM2ForCausalLM",
    "laguna": "LagunaForCausalLM",
    # No causal-LM class of its own (its multimodal model holds the head): the text decoder's.
    "muse_glimmer_text": "MuseGlimmerTextModel",
    "qwen3_vl_text": "Qwen3VLTextModel",
    "qwen3_vl_moe_text": "Qwen3VLMoeTextModel",
    # Encoders: their base model's (a cross-encoder's config says so: EncoderOptions.to_hf).
    **{model_type: classes[0] for model_type, classes in ENCODER_ARCHITECTURES.items()},
}
SUPPORTED_MODEL_TYPES = tuple(ARCHITECTURES)
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
LayerType = Literal["full_attention", "sliding_attention", "linear_attention"]
OutputGate = Literal["per-head", "per-element"]
LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention")
GEMMA = ("gemma2", "gemma3_text", "gemma4_text")
ROPE_PER_LAYER_TYPE = ("gemma3_text", "gemma4_text", "laguna")  # a rope dict per layer type
# Families with linear-attention layers beside full attention.
HYBRID = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
QWEN = ("qwen2", "qwen3")
QWEN3_VL = ("qwen3_vl_text", "qwen3_vl_moe_text")
# Families whose attention keeps a latent per token (multi-head latent attention).
MLA = ("deepseek_v3", "glm4_moe_lite", "mistral4", *DSA)
# Families whose every layer slides once a window is set.
ALL_LAYERS_SLIDE = ("mistral", "phi3", "mixtral", "qwen3_moe")
REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads")

# What transformers assumes for keys a config.json leaves out, where a family differs.
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "mistral": {"sliding_window": 4096},
    "qwen3": {"head_dim": 128},
    "glm4_moe": {"partial_rotary_factor": 0.5},
    "mistral4": {"first_k_dense_replace": 0, "q_lora_rank": 1024},
    "minimax_m2": {"head_dim": 128, "rope_theta": 5_000_000.0},
    "laguna": {"head_dim": 128, "sliding_window": 512, "shared_expert_intermediate_size": 512,
               "rope_parameters": {
                   "full_attention": {"rope_type": "default", "rope_theta": 500_000.0,
                                      "partial_rotary_factor": 0.5},
                   "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}},
    "gpt_oss": {"head_dim": 64, "sliding_window": 128, "attention_bias": True},
    "gemma4_text": gemma4_config.DEFAULTS,
    **encoder_config.DEFAULTS,
    "muse_glimmer_text": muse_glimmer_config.DEFAULTS,
    "qwen3_5_text": {"partial_rotary_factor": 0.25},
    "qwen3_5_moe_text": {"partial_rotary_factor": 0.25},
    "qwen3_next": {"partial_rotary_factor": 0.25},
    "qwen3_vl_text": qwen3_vl_config.DEFAULTS,
    "qwen3_vl_moe_text": qwen3_vl_config.DEFAULTS,
    "gemma2": {"head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 4096,
               "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
               "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True},
    "gemma3_text": {"head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 4096,
                    "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True},
}


def sliding_window(cfg: dict[str, Any]) -> int | None:
    model_type = cfg["model_type"]
    if model_type == "llama":
        return None  # transformers' Llama has no window, whatever the config says
    if model_type in (*QWEN, "qwen3_moe") and not cfg.get("use_sliding_window"):
        return None
    if model_type in ("glm4_moe", "minimax_m2", *HYBRID, *QWEN3_VL):
        return None  # their transformers classes have no window
    return cfg.get("sliding_window")


def layer_heads(cfg: dict[str, Any]) -> tuple[int, ...]:
    """Laguna's per-layer query heads, where they are not all num_attention_heads."""
    heads = tuple(cfg.get("num_attention_heads_per_layer") or ())
    return heads if set(heads) - {cfg["num_attention_heads"]} else ()


def output_gate(cfg: dict[str, Any]) -> OutputGate | None:
    """Laguna's `gating`: true or "per-head" gates each head, "per-element" each feature
    (transformers reads false as per element too, mlx-lm as no gate: it is refused). Muse
    Glimmer gates each feature."""
    if cfg["model_type"] == "muse_glimmer_text":
        return "per-element"
    if cfg["model_type"] != "laguna":
        return None
    gating = cfg.get("gating", True)
    if gating is True or gating == "per-head":
        return "per-head"
    if gating == "per-element":
        return "per-element"
    raise ValueError(f"config.json sets gating={gating!r}: this laguna attention gate is not "
                     "supported (supported: true, 'per-head', 'per-element')")


def rotary_dim_as_share(cfg: dict[str, Any]) -> dict[str, Any]:
    """MiniMax M2's released configs give the rotated width as `rotary_dim`; transformers
    takes it as a share of head_dim where no partial_rotary_factor is set."""
    if cfg.get("rotary_dim") is None or cfg.get("partial_rotary_factor") is not None:
        return cfg
    return {**cfg, "partial_rotary_factor": cfg["rotary_dim"] / cfg["head_dim"]}


def mla_head_dim(mla: MlaConfig, rope: RopeParameters) -> int:
    """The head size the rope's partial_rotary_factor is a share of, as transformers sets
    head_dim: the rope part itself (DeepSeek, factor 1) or a whole q/k head (Mistral 4, the
    rope part's share). Either way the rope turns the rope part only."""
    return round(mla.qk_rope_head_dim / rope.partial_rotary_factor)


def layer_types(cfg: dict[str, Any], window: int | None) -> tuple[LayerType, ...]:
    """Which layers slide. ALL_LAYERS_SLIDE families slide on every layer once a window is set."""
    n, model_type = cfg["num_hidden_layers"], cfg["model_type"]
    if model_type == "laguna":  # every layer full unless listed
        return listed_layer_types(cfg) or ("full_attention",) * n
    if model_type == "muse_glimmer_text":
        return listed_layer_types(cfg) or muse_glimmer_config.default_layer_types(n)
    if model_type in HYBRID:
        return listed_layer_types(cfg) or tuple(
            "full_attention" if (i + 1) % cfg.get("full_attention_interval", 4) == 0
            else "linear_attention" for i in range(n))
    if window is None and model_type not in GEMMA:
        return ()
    if model_type in ALL_LAYERS_SLIDE:
        return ("sliding_attention",) * n
    if cfg.get("layer_types"):
        return listed_layer_types(cfg)
    if model_type == "gpt_oss":  # alternates, sliding first
        return tuple("full_attention" if i % 2 else "sliding_attention" for i in range(n))
    if model_type in GEMMA:
        # Gemma 2 alternates; Gemma 3 has one global layer every `sliding_window_pattern`.
        pattern = 2 if model_type == "gemma2" else (
            cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
        if model_type == "gemma4_text":
            types[-1] = "full_attention"  # transformers makes the last layer global
        return tuple(types)
    first = cfg.get("max_window_layers", 28)  # Qwen: layers from this one on slide
    return tuple("sliding_attention" if i >= first else "full_attention" for i in range(n))


def listed_layer_types(cfg: dict[str, Any]) -> tuple[LayerType, ...]:
    types = tuple(cfg.get("layer_types") or ())
    linear_ok = cfg["model_type"] in HYBRID
    allowed = set(LAYER_TYPES) - (set() if linear_ok else {"linear_attention"})
    unknown = set(types) - allowed
    if unknown:
        raise ValueError(f"layer types {sorted(unknown)} are not supported")
    return types


def ropes(cfg: dict[str, Any]) -> tuple[RopeParameters, RopeParameters | None]:
    """(rope of full-attention layers, rope of sliding layers if it differs)."""
    params = cfg.get("rope_parameters") or {}
    if cfg["model_type"] not in ROPE_PER_LAYER_TYPE:
        theta = read_rope_theta(cfg)
        rope = read_rope(cfg, params or cfg.get("rope_scaling"), theta)
        return qwen3_vl_config.with_mrope_section(cfg["model_type"], rope), None
    if "full_attention" in params:  # transformers 5: one dict per layer type
        full, local = params["full_attention"], params.get("sliding_attention")
    else:  # older: rope_theta and rope_scaling are global, rope_local_base_freq local
        full, local = cfg.get("rope_scaling") or params, None
    theta = float(cfg.get("rope_theta") or 1_000_000.0)
    local_theta = float(cfg.get("rope_local_base_freq") or 10_000.0)
    return read_rope(cfg, full, theta), read_rope(cfg, local, local_theta)
