"""A multimodal checkpoint's text model: which families wrap one, and its config.

A vision-language checkpoint (Gemma 3/4, Qwen3.5, Qwen3-VL, Kimi K2.5, Muse Glimmer) nests
its text model's config under `text_config` and names itself by the wrapper's model_type;
the engine serves the text model (and, beside it, the vision tower: metal_engine.vision).
"""

from __future__ import annotations

from typing import Any

from metal_engine.models import qwen3_vl_config

# Multimodal checkpoints whose text part is served: model_type -> the text model's.
TEXT_PARTS = {"gemma3": "gemma3_text", "gemma4": "gemma4_text", "qwen3_5": "qwen3_5_text",
              "qwen3_5_moe": "qwen3_5_moe_text", "muse_glimmer": "muse_glimmer_text",
              "kimi_k25": "deepseek_v3",  # Kimi K2.5's text model is Kimi K2's
              **qwen3_vl_config.TEXT_PARTS}


def text_part_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A multimodal checkpoint's text model config (tokens ids may sit at the top level)."""
    text_type = TEXT_PARTS.get(cfg.get("model_type"))
    if text_type is None:
        return cfg
    inherited = {k: cfg[k] for k in ("bos_token_id", "eos_token_id") if k in cfg}
    text = {**inherited, **(cfg.get("text_config") or {}), "model_type": text_type}
    if "tie_word_embeddings" in cfg:  # transformers ties by the outer config's
        text["tie_word_embeddings"] = cfg["tie_word_embeddings"]
    return text
