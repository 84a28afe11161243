"""llama.cpp's `deepseek2` architecture: DeepSeek V3 / R1, Kimi K2 and GLM-4.7-Flash with
multi-head latent attention (MLA), converted to `deepseek_v3` (`glm4_moe_lite` for
GLM-4.7-Flash, which runs the same layers; llama.cpp's converter marks it by its `glm4`
pre-tokenizer).

What llama.cpp's converter (conversion/deepseek.py, DeepseekV2Model) changes, and how it is
read back:

- `kv_b_proj` `[heads * (nope + v), rank]` is split per head into `attn_k_b` (each head's key
  rows, transposed: `[heads, rank, nope]`) and `attn_v_b` (`[heads, v, rank]`); joined back
  here. Files written before that split hold `attn_kv_b`, the Hugging Face tensor as it is.
- The metadata describes the absorbed form, one key/value head (`head_count_kv` 1) of
  `key_length = rank + rope`, `value_length = rank`; the per-head sizes are `key_length_mla`
  and `value_length_mla` (older files: `key_length` and `value_length`).
- No rope rows are permuted: llama.cpp runs this architecture's rope on adjacent pairs
  (LLAMA_ROPE_TYPE_NORM), which is DeepSeek's `rope_interleave`.
- YaRN's `mscale_all_dim` is stored times 0.1 as `rope.scaling.yarn_log_multiplier`; llama.cpp
  takes `mscale` equal to it for this architecture (as the released configs have it).
- The router's `e_score_correction_bias` is `exp_probs_b.bias`; experts are stacked as for
  the other MoE architectures (convert.gguf_moe); multi-token-prediction blocks are counted in
  `block_count` and left out.

Refused: softmax-routed files (DeepSeek V2 / V2.5 / V2-Lite, Mistral's deepseek2 conversions,
and files that name no gating function, which llama.cpp then routes by softmax), files without
experts (Youtu-LLM), and attention temperature scaling.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import ReaderTensor
from gguf.quants import dequantize

from convert.gguf_moe import GLM_EXPERT_NAMES, Metadata, glm4_moe_keys, shortest

DEEPSEEK2_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "attn_k_b": "self_attn.k_b_proj",  # these two are joined into kv_b_proj
    "attn_v_b": "self_attn.v_b_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    **GLM_EXPERT_NAMES,
}
SIGMOID = 2  # llama.cpp's expert_gating_func for DeepSeek V3's routing
_KV_B = ".self_attn.kv_b_proj.weight"
_K_B = ".self_attn.k_b_proj.weight"
_V_B = ".self_attn.v_b_proj.weight"


def deepseek2_keys(model_type: str, meta: Metadata, names: Collection[str],
                   layers: int) -> dict[str, Any]:
    """The Hugging Face config keys of a deepseek2 file's metadata (MLA, experts, YaRN)."""
    glm = model_type == "glm4_moe_lite"
    if not meta("expert_count"):
        raise ValueError("this deepseek2 GGUF has no routed experts (a dense model such as "
                         "Youtu-LLM); metal-serve reads deepseek2 files of DeepSeek V3 / R1, "
                         "Kimi K2 and GLM-4.7-Flash")
    # llama.cpp's default where the file names none: softmax, but sigmoid for GLM-4.7-Flash.
    gating = meta("expert_gating_func") or (SIGMOID if glm else 1)
    if gating != SIGMOID:
        raise ValueError(
            f"this deepseek2 GGUF routes its experts by llama.cpp gating function {gating} "
            "(1: softmax, as DeepSeek V2 / V2.5 / V2-Lite and Mistral's deepseek2 files do, and "
            "as llama.cpp assumes where the file names none); metal-serve runs DeepSeek V3's "
            "sigmoid routing (gating function 2) only")
    if meta("attention.temperature_scale"):
        raise ValueError("this deepseek2 GGUF scales attention by position "
                         "(attention.temperature_scale, Mistral's llama_4_scaling); not supported")
    heads = meta("attention.head_count")
    rope = _required(meta, "rope.dimension_count")
    key = meta("attention.key_length_mla") or _required(meta, "attention.key_length")
    value = meta("attention.value_length_mla") or _required(meta, "attention.value_length")
    keys = {k: v for k, v in glm4_moe_keys(meta, names, layers).items() if k != "use_qk_norm"}
    keys.update(
        model_type=model_type,
        num_key_value_heads=heads,  # llama.cpp's 1 is the absorbed form's
        head_dim=rope,
        kv_lora_rank=_required(meta, "attention.kv_lora_rank"),
        q_lora_rank=meta("attention.q_lora_rank") or None,
        qk_rope_head_dim=rope,
        qk_nope_head_dim=key - rope,
        v_head_dim=value,
        rope_interleave=True,
    )
    if glm:  # transformers' Glm4MoeLite lists its dense layers
        dense = keys["first_k_dense_replace"]
        keys["mlp_layer_types"] = ["dense"] * dense + ["sparse"] * (layers - dense)
    if meta("rope.scaling.type") == "yarn":
        keys["rope_scaling"] = _yarn(meta)
    return keys


def _yarn(meta: Metadata) -> dict[str, Any]:
    """DeepSeek's YaRN settings as its config.json has them."""
    if (meta("rope.scaling.yarn_ext_factor") or 1.0) != 1.0:
        raise ValueError("this deepseek2 GGUF sets a YaRN extrapolation factor other than 1 "
                         "(rope.scaling.yarn_ext_factor); not supported")
    scaling: dict[str, Any] = {
        "rope_type": "yarn", "factor": shortest(_required(meta, "rope.scaling.factor")),
        "original_max_position_embeddings": _required(meta,
                                                      "rope.scaling.original_context_length"),
        "beta_fast": shortest(meta("rope.scaling.yarn_beta_fast") or 32.0),
        "beta_slow": shortest(meta("rope.scaling.yarn_beta_slow") or 1.0)}
    if (attention_factor := meta("rope.scaling.yarn_attn_factor")) is not None:
        scaling["attention_factor"] = shortest(attention_factor)
    if log_multiplier := meta("rope.scaling.yarn_log_multiplier"):
        # Written as 0.1 * mscale_all_dim (llama.cpp divides by 0.1 in float32 on reading).
        mscale = float(f"{np.float32(log_multiplier) / np.float32(0.1):.6g}")
        scaling.update(mscale=mscale, mscale_all_dim=mscale)
    return scaling


@dataclass(frozen=True)
class SplitKvB:
    """One layer's `kv_b_proj` as llama.cpp's converter stores it, in two tensors; `shape` and
    `tensor_type` as a ReaderTensor's (ggml order) for the joined tensor."""

    keys: ReaderTensor  # attn_k_b: ggml [nope, rank, heads]
    values: ReaderTensor  # attn_v_b: ggml [rank, v, heads]

    @property
    def shape(self) -> tuple[int, ...]:
        nope, rank, heads = (int(d) for d in self.keys.shape)
        return rank, heads * (nope + int(self.values.shape[1]))

    @property
    def tensor_type(self) -> Any:
        return self.keys.tensor_type

    def joined(self) -> np.ndarray:
        """`kv_b_proj` `[heads * (nope + v), rank]`: each head's key rows, then its value rows."""
        keys, values = (dequantize(t.data, t.tensor_type).reshape(_numpy_shape(t))
                        for t in (self.keys, self.values))
        per_head = np.concatenate([keys.swapaxes(1, 2), values], axis=1)  # [H, nope + v, rank]
        return per_head.reshape(-1, per_head.shape[-1])


def join_kv_b(tensors: dict[str, Any]) -> dict[str, Any]:
    """`tensors` (by Hugging Face name) with each layer's `k_b_proj` / `v_b_proj` pair replaced
    by one SplitKvB under `kv_b_proj`; where a file also holds the unsplit `kv_b_proj`, that is
    kept and the pair dropped. A lone half stays, for the layout check to name."""
    joined: dict[str, Any] = {}
    for name, tensor in tensors.items():
        if name.endswith(_K_B) and (values := name.removesuffix(_K_B) + _V_B) in tensors:
            whole = name.removesuffix(_K_B) + _KV_B
            if whole not in tensors:
                joined[whole] = SplitKvB(tensor, tensors[values])
        elif not (name.endswith(_V_B) and name.removesuffix(_V_B) + _K_B in tensors):
            joined[name] = tensor
    return joined


def _numpy_shape(tensor: ReaderTensor) -> tuple[int, ...]:
    return tuple(int(d) for d in reversed(tensor.shape))


def _required(meta: Metadata, key: str) -> Any:
    value = meta(key)
    if value is None:
        raise ValueError(f"the GGUF metadata lacks the deepseek2 key {key!r}; the file is "
                         "incomplete")
    return value
