"""What the Qwen vision-language text models read beyond their text-only kin: Qwen3-VL's
text models (qwen3_vl_text, qwen3_vl_moe_text: Qwen3's and Qwen3-MoE's layers, named in a
multimodal checkpoint's `text_config`), and the multimodal rope section of every family that
turns image tokens by 3-D positions (models/rope.py)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from metal_engine.models.rope_parameters import RopeParameters

# Multimodal model_type -> its text model's.
TEXT_PARTS = {"qwen3_vl": "qwen3_vl_text", "qwen3_vl_moe": "qwen3_vl_moe_text"}
# What transformers' Qwen3VLTextConfig assumes for keys a config leaves out.
DEFAULTS: dict[str, Any] = {"head_dim": 128, "rope_theta": 500_000.0}
# The rope sections transformers' rotary embeddings take where a config lists none.
MROPE_SECTIONS = {
    "qwen3_vl_text": (24, 20, 20), "qwen3_vl_moe_text": (24, 20, 20),
    "qwen3_5_text": (11, 11, 10), "qwen3_5_moe_text": (11, 11, 10),
}  # fmt: skip


def with_mrope_section(model_type: str, rope: RopeParameters) -> RopeParameters:
    """`rope` with its family's multimodal rope section where the config gave none."""
    section = MROPE_SECTIONS.get(model_type)
    if section is None or rope.mrope_section is not None:
        return rope
    return replace(rope, mrope_section=section)
