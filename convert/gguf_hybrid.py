"""llama.cpp's hybrid linear-attention architectures: qwen35 (Qwen3.5), qwen35moe (Qwen3.5-MoE)
and qwen3next (Qwen3-Next). Their tensor names, the config their metadata describes, and the
changes llama.cpp's converter made to the weights, undone:

- `A_log` is stored as `ssm_a = -exp(A_log)`, `dt_bias` as `ssm_dt.bias`;
- the conv is squeezed to `[C, K]` (Hugging Face's is `[C, 1, K]`);
- the norms that scale by `1 + w` (all but the gated `ssm_norm`) carry the 1;
- Qwen3-Next's `in_proj_qkvz` is stored split (`attn_qkv` + `attn_gate`), its `in_proj_ba` fused
  (`ssm_ba`, split at conversion as a Hugging Face checkpoint's is);
- qwen35 / qwen35moe reorder the value heads, where there are more of them than key heads, from
  grouped by key head (`k0v0 k0v1 k1v0 k1v1`, Hugging Face's) to tiled (`k0v0 k1v0 k0v1 k1v1`),
  in every tensor with a value-head axis.

Which layers attend fully is `full_attention_interval` (every n-th layer).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import numpy as np

from convert.gguf_moe import EXPERT_NAMES, Metadata, moe_layers
from metal_engine.loading.model_config import ModelConfig

LINEAR_ATTENTION_NAMES = {
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_ba": "linear_attn.in_proj_ba",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_a": "linear_attn.A_log",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
    "post_attention_norm": "post_attention_layernorm",
}
SHARED_EXPERT_NAMES = {
    **EXPERT_NAMES,
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
_PLAIN_NORM = "linear_attn.norm.weight"  # the gated norm scales by w


def hybrid_keys(model_type: str, meta: Metadata, names: Collection[str],
                layers: int) -> dict[str, Any]:
    """The Hugging Face config keys of a qwen35 / qwen35moe / qwen3next file's metadata."""
    interval = meta("full_attention_interval") or 4
    value_heads = _required(meta, "ssm.time_step_rank")
    head_dim = (meta("attention.key_length")
                or meta("embedding_length") // meta("attention.head_count"))
    keys: dict[str, Any] = {
        "partial_rotary_factor": _required(meta, "rope.dimension_count") / head_dim,
        "linear_conv_kernel_dim": _required(meta, "ssm.conv_kernel"),
        "linear_key_head_dim": _required(meta, "ssm.state_size"),
        "linear_num_key_heads": _required(meta, "ssm.group_count"),
        "linear_num_value_heads": value_heads,
        "linear_value_head_dim": _required(meta, "ssm.inner_size") // value_heads,
        "layer_types": ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                        for i in range(layers)],
    }
    sections = meta("rope.dimension_sections")
    if sections is not None and model_type != "qwen3_next":
        # llama.cpp turns Qwen3.5's image tokens with the interleaved multimodal rope.
        keys["rope_scaling"] = {"rope_type": "default",
                                "mrope_section": [int(n) for n in sections[:3]],
                                "mrope_interleaved": True}
    if model_type == "qwen3_5_text":
        return keys
    experts = moe_layers(names, layers)
    return {
        **keys,
        "num_experts": _required(meta, "expert_count"),
        "num_experts_per_tok": _required(meta, "expert_used_count"),
        "moe_intermediate_size": _required(meta, "expert_feed_forward_length"),
        "shared_expert_intermediate_size": meta("expert_shared_feed_forward_length") or 0,
        # A config without a dense FFN width gives llama.cpp none to write; no layer needs it.
        "intermediate_size": (meta("feed_forward_length")
                              or _required(meta, "expert_feed_forward_length")),
        "norm_topk_prob": True,  # llama.cpp renormalizes the chosen experts' weights
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(layers) if i not in experts],
    }


def restore_hybrid(name: str, weights: np.ndarray, config: ModelConfig,
                   tiled: bool) -> np.ndarray:
    """One tensor (Hugging Face name, `[out, in]` shape) as the Hugging Face checkpoint held it,
    from what llama.cpp stored; `tiled`: the file's value heads are in tiled order."""
    if name.endswith("norm.weight") and not name.endswith(_PLAIN_NORM):
        return weights - np.float32(1)
    if name.endswith("linear_attn.A_log"):
        weights = np.log(-weights)
    linear = config.linear_attention
    if not tiled or ".linear_attn." not in name or linear.num_key_heads == linear.num_value_heads:
        return weights
    heads = (linear.num_key_heads, linear.num_value_heads)
    values = slice(2 * linear.key_dim, None)  # q and k come first in in_proj_qkv and the conv
    if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
        weights = weights.copy()
        weights[values] = _grouped(weights[values], 0, *heads)
        return weights
    if name.endswith(("in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight",
                      "A_log", "dt_bias")):
        return _grouped(weights, 0, *heads)
    if name.endswith("out_proj.weight"):
        return _grouped(weights, 1, *heads)
    return weights


def _grouped(weights: np.ndarray, axis: int, key_heads: int, value_heads: int) -> np.ndarray:
    """Value heads along `axis` from tiled order (`[per_key, key_heads, head]`) to grouped
    (`[key_heads, per_key, head]`); `head` is what the axis holds per value head (its width,
    or 1)."""
    moved = np.moveaxis(weights, axis, 0)
    head = moved.shape[0] // value_heads
    tiled = moved.reshape(value_heads // key_heads, key_heads, head, *moved.shape[1:])
    return np.moveaxis(tiled.swapaxes(0, 1).reshape(moved.shape), 0, axis)


def _required(meta: Metadata, key: str) -> Any:
    value = meta(key)
    if value is None:
        raise ValueError(f"the GGUF metadata lacks the linear-attention key {key!r}; the file "
                         "is incomplete")
    return value
