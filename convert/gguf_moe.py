"""llama.cpp's mixture-of-experts architectures (qwen3moe, glm4moe, gpt-oss, and Mixtral, which
llama.cpp writes as `llama` with experts): expert tensor names and the Hugging Face MoE config
keys their metadata describes.

llama.cpp stores each layer's experts stacked, `ffn_{gate,up,down}_exps` with ggml dims
`[in, out, experts]`, which read reversed are the `[experts, out, in]` of `switch_mlp.*` here.
Which layers have experts is read from the tensors (a layer without `ffn_gate_inp` is dense).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import numpy as np

Metadata = Callable[[str], Any]  # key without the "{arch}." prefix -> value or None

EXPERT_NAMES = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_up_exps": "mlp.switch_mlp.up_proj",
    "ffn_down_exps": "mlp.switch_mlp.down_proj",
}
MIXTRAL_EXPERT_NAMES = {short: name.replace("mlp.", "block_sparse_moe.", 1)
                        for short, name in EXPERT_NAMES.items()}
# GLM-4.5's shared expert, and its router's choice-only bias (a `.bias` in GGUF, a parameter of
# its own in Hugging Face's layout).
GLM_EXPERT_NAMES = {
    **EXPERT_NAMES,
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
}
# GPT-OSS: router and experts with biases, under its own names; each head's sink logit.
GPT_OSS_NAMES = {
    "ffn_gate_inp": "mlp.router",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "attn_sinks.weight": "self_attn.sinks",
}
# llama.cpp's expert_gating_func values -> Hugging Face's scoring_func.
GATING_FUNCS = {1: "softmax", 2: "sigmoid"}


def moe_layers(names: Collection[str], layers: int, router: str = "mlp.gate") -> set[int]:
    """The layers whose router is among the Hugging Face tensor `names`."""
    return {i for i in range(layers) if f"model.layers.{i}.{router}.weight" in names}


def mixtral_keys(meta: Metadata, names: Collection[str], layers: int) -> dict[str, Any]:
    """Mixtral's config keys; its experts are feed_forward_length wide, in every layer."""
    routers = {f"model.layers.{i}.block_sparse_moe.gate.weight" for i in range(layers)}
    if not routers <= set(names):
        raise ValueError("this llama GGUF with experts lacks some layers' routers "
                         "(ffn_gate_inp); the file is incomplete")
    return {"num_local_experts": _required(meta, "expert_count"),
            "num_experts_per_tok": _required(meta, "expert_used_count")}


def qwen3_moe_keys(meta: Metadata, names: Collection[str], layers: int) -> dict[str, Any]:
    """Qwen3-MoE's config keys. llama.cpp always renormalizes the chosen experts' weights for
    this architecture, as the released models' norm_topk_prob says."""
    experts = moe_layers(names, layers)
    return {
        **_expert_keys(meta),
        "num_experts": _required(meta, "expert_count"),
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(layers) if i not in experts],
    }


def glm4_moe_keys(meta: Metadata, names: Collection[str], layers: int) -> dict[str, Any]:
    """GLM-4.5's config keys, with llama.cpp's defaults where the metadata is silent (also the
    MoE part of deepseek2's: convert.gguf_mla)."""
    dense = meta("leading_dense_block_count") or 0
    if moe_layers(names, layers) != set(range(dense, layers)):
        raise ValueError(f"this GGUF has experts in other layers than the ones after its "
                         f"{dense} leading dense ones; the file is inconsistent")
    gating = meta("expert_gating_func") or 2
    return {
        **_expert_keys(meta),
        "n_routed_experts": _required(meta, "expert_count"),
        "n_shared_experts": meta("expert_shared_count") or 0,
        "first_k_dense_replace": dense,
        "routed_scaling_factor": shortest(meta("expert_weights_scale") or 1.0),
        "norm_topk_prob": bool(meta("expert_weights_norm")),
        "n_group": meta("expert_group_count") or 1,
        "topk_group": meta("expert_group_used_count") or 1,
        # An unknown function passes through by its number, for the config's refusal to name.
        "scoring_func": GATING_FUNCS.get(gating, f"llama.cpp gating function {gating}"),
        "topk_method": "noaux_tc",
        "use_qk_norm": "model.layers.0.self_attn.q_norm.weight" in names,
    }


def gpt_oss_keys(meta: Metadata, names: Collection[str], layers: int) -> dict[str, Any]:
    """GPT-OSS's config keys. llama.cpp slides every other layer from the first (as the
    released configs' layer_types do), fixes the clamped SwiGLU at alpha 1.702, limit 7, and
    keeps only yarn's betas; yarn's corrections are GPT-OSS's own untruncated ones."""
    if moe_layers(names, layers, router="mlp.router") != set(range(layers)):
        raise ValueError("this gpt-oss GGUF lacks some layers' routers (ffn_gate_inp); the "
                         "file is incomplete")
    scaling = rope_scaling_yarn(meta)
    return {
        "num_local_experts": _required(meta, "expert_count"),
        "num_experts_per_tok": _required(meta, "expert_used_count"),
        "intermediate_size": _one_width(_required(meta, "expert_feed_forward_length")),
        "sliding_window": _required(meta, "attention.sliding_window"),
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention"
                        for i in range(layers)],
        "swiglu_limit": 7.0,
        **({"rope_scaling": scaling} if scaling else {}),
    }


def rope_scaling_yarn(meta: Metadata) -> dict[str, Any] | None:
    if meta("rope.scaling.type") != "yarn":
        return None
    return {"rope_type": "yarn", "factor": shortest(meta("rope.scaling.factor")),
            "original_max_position_embeddings": meta("rope.scaling.original_context_length"),
            "beta_fast": shortest(meta("rope.scaling.yarn_beta_fast") or 32.0),
            "beta_slow": shortest(meta("rope.scaling.yarn_beta_slow") or 1.0),
            "truncate": False}


def _expert_keys(meta: Metadata) -> dict[str, Any]:
    return {"num_experts_per_tok": _required(meta, "expert_used_count"),
            "moe_intermediate_size": _one_width(_required(meta, "expert_feed_forward_length"))}


def _one_width(value: int | list[int]) -> int:
    """llama.cpp may store the expert width per layer; the families here have one width."""
    if not isinstance(value, list):
        return value
    if len(set(value)) != 1:
        raise ValueError(f"this GGUF's experts differ in width by layer ({sorted(set(value))}); "
                         "metal-serve runs one expert width per model")
    return value[0]


def shortest(value: float) -> float:
    # Stored as float32: its shortest decimal form is the config's value (2.5, 1.8).
    return float(str(np.float32(value)))


def _required(meta: Metadata, key: str) -> Any:
    value = meta(key)
    if value is None:
        raise ValueError(f"the GGUF metadata lacks the MoE key {key!r}; the file is incomplete")
    return value
