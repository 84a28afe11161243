"""llama.cpp architectures the GGUF converter reads: tensor names, the config its metadata
describes, and what llama.cpp's own converter changed in the weights.

Mistral GGUFs carry the `llama` architecture (llama.cpp writes them so); they convert to
`model_type: llama`, which computes the same. The MoE architectures' parts are in
convert.gguf_moe, the hybrid linear-attention ones' (Qwen3.5, Qwen3-Next) in convert.gguf_hybrid,
the multi-head latent attention ones' (deepseek2: DeepSeek V3, Kimi K2, GLM-4.7-Flash) in
convert.gguf_mla.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from convert.gguf_hybrid import LINEAR_ATTENTION_NAMES, SHARED_EXPERT_NAMES, hybrid_keys
from convert.gguf_mla import DEEPSEEK2_NAMES, deepseek2_keys
from convert.gguf_moe import (
    EXPERT_NAMES,
    GLM_EXPERT_NAMES,
    GPT_OSS_NAMES,
    MIXTRAL_EXPERT_NAMES,
    Metadata,
    glm4_moe_keys,
    gpt_oss_keys,
    mixtral_keys,
    qwen3_moe_keys,
)

COMMON_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
PRE_NORM_NAMES = {**COMMON_BLOCK_NAMES, "ffn_norm": "post_attention_layernorm"}
SANDWICH_NAMES = {
    **COMMON_BLOCK_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
QK_NORM_NAMES = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
GLM_NAMES = {**COMMON_BLOCK_NAMES, **QK_NORM_NAMES, **GLM_EXPERT_NAMES,
             "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm"}
HYBRID_NAMES = {**COMMON_BLOCK_NAMES, **QK_NORM_NAMES, **LINEAR_ATTENTION_NAMES}
# llama.cpp scales Gemma's queries by hidden/heads instead of head_dim for the 27B models,
# which it recognises by their layer count; the Hugging Face configs agree.
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


@dataclass(frozen=True)
class GgufArch:
    model_type: str
    block_names: dict[str, str]
    permutes_qk: bool = False  # llama.cpp interleaved q/k rows for its rope kernel
    norm_offset: float = 0.0  # llama.cpp stored Gemma's `1 + w` norm weights with the 1 added
    partial_rotary: bool = False  # rope.dimension_count is the rotated part of a head (GLM)
    # Linear-attention layers, and the order llama.cpp stored their value heads in.
    value_heads: Literal["grouped", "tiled"] | None = None

    def config_keys(self, arch: str, meta: Metadata, names: Collection[str],
                    layers: int) -> dict[str, Any]:
        """Config keys beyond the shared ones (experts, soft-capping, windows, Gemma's query
        scale); `names` are the file's tensors by Hugging Face name."""
        if self.value_heads is not None:
            return hybrid_keys(self.model_type, meta, names, layers)
        if self.model_type in ("deepseek_v3", "glm4_moe_lite"):
            return deepseek2_keys(self.model_type, meta, names, layers)
        if self.model_type == "mixtral":
            return mixtral_keys(meta, names, layers)
        if self.model_type == "qwen3_moe":
            return qwen3_moe_keys(meta, names, layers)
        if self.model_type == "gpt_oss":
            return gpt_oss_keys(meta, names, layers)
        if self.model_type == "glm4_moe":
            return {**glm4_moe_keys(meta, names, layers),
                    "partial_rotary_factor": meta("rope.dimension_count") / head_dim(meta, self)}
        if self.model_type not in ("gemma2", "gemma3_text"):
            return {}
        keys: dict[str, Any] = {"sliding_window": meta("attention.sliding_window")}
        if meta("block_count") == GEMMA_27B_LAYERS[arch]:
            keys["query_pre_attn_scalar"] = meta("embedding_length") // meta("attention.head_count")
        else:
            keys["query_pre_attn_scalar"] = meta("attention.key_length")
        if arch == "gemma2":
            keys["attn_logit_softcapping"] = meta("attn_logit_softcapping")
            keys["final_logit_softcapping"] = meta("final_logit_softcapping")
            return keys
        keys["rope_local_base_freq"] = meta("rope.freq_base_swa") or 10000.0
        pattern = meta("attention.sliding_window_pattern")
        if isinstance(pattern, list):  # one flag per layer: does it slide
            keys["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
        elif pattern:
            keys["sliding_window_pattern"] = pattern
        return keys


ARCHS = {
    "llama": GgufArch("llama", PRE_NORM_NAMES, permutes_qk=True),
    "qwen2": GgufArch("qwen2", PRE_NORM_NAMES),
    "qwen3": GgufArch("qwen3", {**PRE_NORM_NAMES, **QK_NORM_NAMES}),
    "gemma2": GgufArch("gemma2", SANDWICH_NAMES, norm_offset=1.0),
    "gemma3": GgufArch("gemma3_text", {**SANDWICH_NAMES, **QK_NORM_NAMES}, norm_offset=1.0),
    "qwen3moe": GgufArch("qwen3_moe", {**PRE_NORM_NAMES, **QK_NORM_NAMES, **EXPERT_NAMES}),
    "glm4moe": GgufArch("glm4_moe", GLM_NAMES, partial_rotary=True),
    "gpt-oss": GgufArch("gpt_oss", {**COMMON_BLOCK_NAMES, **GPT_OSS_NAMES,
                                    "post_attention_norm": "post_attention_layernorm"}),
    "qwen35": GgufArch("qwen3_5_text", HYBRID_NAMES, partial_rotary=True, value_heads="tiled"),
    "qwen35moe": GgufArch("qwen3_5_moe_text", {**HYBRID_NAMES, **SHARED_EXPERT_NAMES},
                          partial_rotary=True, value_heads="tiled"),
    "qwen3next": GgufArch("qwen3_next", {**HYBRID_NAMES, **SHARED_EXPERT_NAMES},
                          partial_rotary=True, value_heads="grouped"),
    "deepseek2": GgufArch("deepseek_v3", DEEPSEEK2_NAMES),
}


# llama.cpp writes Mixtral as `llama` with experts (and q/k permuted, as for Llama).
MIXTRAL = GgufArch("mixtral", {**PRE_NORM_NAMES, **MIXTRAL_EXPERT_NAMES}, permutes_qk=True)
# GLM-4.7-Flash as `deepseek2`, told from DeepSeek's and Kimi's files by its pre-tokenizer.
GLM4_MOE_LITE = GgufArch("glm4_moe_lite", DEEPSEEK2_NAMES)


def gguf_arch(arch_name: str, meta: Metadata, tokenizer_pre: str | None = None) -> GgufArch:
    """How to read a file of the architecture `arch_name` (one of ARCHS) whose
    `tokenizer.ggml.pre` is `tokenizer_pre`."""
    if arch_name == "llama" and meta("expert_count"):
        return MIXTRAL
    if arch_name == "deepseek2" and tokenizer_pre == "glm4":
        return GLM4_MOE_LITE
    return ARCHS[arch_name]


def head_dim(meta: Metadata, arch: GgufArch) -> int:
    """Width of one attention head: key_length, else the rotary width where it is the whole
    head, else llama.cpp's default of hidden / heads."""
    rotary = None if arch.partial_rotary else meta("rope.dimension_count")
    return (meta("attention.key_length") or rotary
            or meta("embedding_length") // meta("attention.head_count"))


def rope_scaling(meta: Metadata) -> dict[str, Any] | None:
    """The Hugging Face `rope_scaling` for llama.cpp's rope scaling keys."""
    kind = meta("rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": meta("rope.scaling.factor")}
    if kind == "yarn":
        return {"rope_type": "yarn", "factor": meta("rope.scaling.factor"),
                "original_max_position_embeddings": meta("rope.scaling.original_context_length")}
    raise ValueError(f"GGUF rope scaling {kind!r} is not supported; supported: linear, yarn")


def llama3_rope_scaling(factors: np.ndarray, theta: float, head_dim: int) -> dict[str, Any]:
    """Llama 3.x rope scaling from the per-frequency divisors llama.cpp stores as rope_freqs.

    The frequencies depend only on the ratios of the original length and the low and high
    frequency factors, so low_freq_factor is taken as 1 and the others are fitted to the band
    where the divisors blend: there `1 / divisor` is linear in `1 / wavelength`.
    """
    factors = np.asarray(factors, np.float64)
    factor = factors.max()
    blended = (factors > 1 + 1e-6) & (factors < factor * (1 - 1e-6))
    if factor <= 1 or blended.sum() < 2:
        raise ValueError("this GGUF's rope_freqs.weight is not Llama 3 rope scaling; convert the "
                         "model's Hugging Face checkpoint instead")
    inverse_wavelength = theta ** -(np.arange(0, head_dim, 2) / head_dim) / (2 * np.pi)
    smooth = (1 / factors - 1 / factor) / (1 - 1 / factor)
    slope, intercept = np.polyfit(inverse_wavelength[blended], smooth[blended], 1)
    return {
        "rope_type": "llama3",
        "factor": _round(factor),
        "low_freq_factor": 1.0,
        "high_freq_factor": _round(1 - 1 / intercept),
        "original_max_position_embeddings": round(-slope / intercept),
    }


def _round(value: float) -> float:
    # The fit recovers float32-stored values; 6 significant digits give back the config's.
    return float(f"{value:.6g}")
