"""The dtype a model runs in under `--dtype auto`.

On the CPU backend, float32: its half-precision matmuls are slow. On an Apple GPU, the
checkpoint's own dtype where it is a half one (bfloat16 stays bfloat16: Gemma 2/3/4, Qwen3
and GPT-OSS ship in it, and Gemma's activations overflow float16); a float32 or unknown
checkpoint runs in float16 as vLLM picks it, but Gemma in bfloat16 for the same overflow.

The checkpoint's dtype is what its publisher saved: a dir converted here records it in its
manifest (its config.json names the dtype written, float32 by default); other dirs say it in
config.json (`dtype`, or `torch_dtype` before transformers 5).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx

from metal_engine.loading.model_config import MANIFEST_FILE

HALF_DTYPES = ("float16", "bfloat16")
# Families whose activations overflow float16 (transformers warns the same for Gemma).
_BFLOAT16_FAMILIES = ("gemma2", "gemma3", "gemma3_text", "gemma4", "gemma4_text")


def resolve_dtype(name: str, model_dir: Path | None = None, *,
                  metal: bool | None = None) -> mx.Dtype:
    """`--dtype`: a dtype's name, or "auto" for `model_dir`'s (see the module doc).
    `metal`: whether the engine runs on an Apple GPU (None: whether this machine has one)."""
    if name != "auto":
        return getattr(mx, name)
    if metal is None:
        metal = mx.metal.is_available()
    if not metal:
        return mx.float32
    return getattr(mx, auto_half_dtype(model_dir))


def auto_half_dtype(model_dir: Path | None) -> str:
    """The half dtype "auto" picks on an Apple GPU for `model_dir`."""
    saved, model_type = _checkpoint_facts(model_dir) if model_dir is not None else (None, None)
    if saved in HALF_DTYPES:
        return saved
    return "bfloat16" if model_type in _BFLOAT16_FAMILIES else "float16"


def source_dtype(raw_config: dict) -> str | None:
    """The dtype a Hugging Face config.json says its weights were saved in."""
    value = raw_config.get("dtype") or raw_config.get("torch_dtype")
    if value is None and isinstance(raw_config.get("text_config"), dict):
        return source_dtype(raw_config["text_config"])
    return value if isinstance(value, str) else None


def _checkpoint_facts(model_dir: Path) -> tuple[str | None, str | None]:
    """(the dtype the checkpoint was published in, its model_type), None where unknown."""
    config = _read_json(Path(model_dir) / "config.json") or {}
    manifest = _read_json(Path(model_dir) / MANIFEST_FILE)
    if manifest is not None:  # converted here: config.json names the dtype written
        saved = manifest.get("source", {}).get("dtype")
    else:
        saved = source_dtype(config)
    return saved, config.get("model_type")


def _read_json(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None
