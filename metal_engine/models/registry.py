"""Which model class runs each Hugging Face `model_type`."""

from __future__ import annotations

from metal_engine.loading.families import SUPPORTED_MODEL_TYPES
from metal_engine.models import (
    bert,
    deepseek_v3,
    dsa,
    gemma2,
    gemma3,
    gemma4,
    glm4_moe,
    gpt_oss,
    laguna,
    llama,
    minimax_m2,
    mistral,
    mistral4,
    mixtral,
    muse_glimmer,
    phi3,
    qwen2,
    qwen3,
    qwen3_5,
    qwen3_moe,
)
from metal_engine.models.decoder import CausalLM
from metal_engine.models.ops_user import OpsModel

MODEL_CLASSES: dict[str, type[OpsModel]] = {
    "llama": llama.Model,
    "mistral": mistral.Model,
    "qwen2": qwen2.Model,
    "qwen3": qwen3.Model,
    "gemma2": gemma2.Model,
    "gemma3_text": gemma3.Model,
    "phi3": phi3.Model,
    "mixtral": mixtral.Model,
    "qwen3_moe": qwen3_moe.Model,
    "glm4_moe": glm4_moe.Model,
    "gpt_oss": gpt_oss.Model,
    "gemma4_text": gemma4.Model,
    "qwen3_5_text": qwen3_5.Model,
    "qwen3_5_moe_text": qwen3_5.Model,
    "qwen3_next": qwen3_5.Model,  # its fused projections are split at conversion
    "deepseek_v3": deepseek_v3.Model,
    "glm4_moe_lite": deepseek_v3.Model,  # GLM-4.7-Flash: DeepSeek V3's layers
    "mistral4": mistral4.Model,
    "deepseek_v32": dsa.Model,  # DeepSeek V3.2: DeepSeek V3's layers, attention made sparse
    "glm_moe_dsa": dsa.Model,  # GLM-5: the same, some layers sharing their indexer's choice
    "minimax_m2": minimax_m2.Model,
    "laguna": laguna.Model,
    "muse_glimmer_text": muse_glimmer.Model,
    # Qwen3-VL's text models: Qwen3's layers, turned by 3-D positions on image tokens.
    "qwen3_vl_text": qwen3.Model,
    "qwen3_vl_moe_text": qwen3_moe.Model,
    # Bidirectional encoders: embedding models and cross-encoders.
    "bert": bert.Model,
    "xlm-roberta": bert.Model,
}


def model_class(model_type: str) -> type[CausalLM] | type[bert.Model]:
    if model_type not in MODEL_CLASSES:
        raise ValueError(f"model_type {model_type!r} is not supported; supported: "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    return MODEL_CLASSES[model_type]
