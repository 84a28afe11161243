"""The layout every source is converted to: Hugging Face config keys and tensor names of the
model's family, as ModelConfig reads them and the model classes name their weights."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from convert.fp8_weights import fp8_block
from convert.mxfp4_experts import is_mxfp4_checkpoint
from metal_engine.loading.model_config import ModelConfig
from metal_engine.loading.quantization import QuantizationConfig, QuantParams
from metal_engine.loading.weights import weight_shapes
from metal_engine.models.decoder import DERIVED_WEIGHTS

# Source checkpoints may carry these; they are derived from the config, so they are dropped.
IGNORED_SUFFIXES = DERIVED_WEIGHTS
# Source config keys not carried over: the rope is written from the ModelConfig alone (a
# leftover Gemma 4 rope_scaling would override its rope_parameters in transformers), and an
# auto_map would name code files the converted dir does not hold.
NOT_CARRIED = ("rope_theta", "rope_scaling", "rope_parameters", "rope_local_base_freq",
               "partial_rotary_factor", "auto_map")


def config_from_hf(config: dict[str, Any]) -> ModelConfig:
    """Read a Hugging Face config.json (transformers 4 or 5 style) of a float checkpoint, of
    GPT-OSS's MXFP4 one, or of a block-quantized FP8 one (DeepSeek's)."""
    if is_mxfp4_checkpoint(config) or fp8_block(config) is not None:
        return ModelConfig.from_dict(config)
    if QuantizationConfig.from_config(config) is not None:  # raises for foreign schemes
        raise ValueError("this checkpoint is already in MLX's quantized layout: serve it as it is "
                         "(`metal-serve serve DIR`), or convert its float checkpoint")
    return ModelConfig.from_dict(config)


def config_dict(config: ModelConfig, dtype: str,
                base: dict[str, Any] | None = None) -> dict[str, Any]:
    """The config.json to write: `base` (the source config, if any) plus every defining key."""
    written = {k: v for k, v in (base or {}).items() if k not in NOT_CARRIED}
    written.update(config.to_hf_dict())
    written["torch_dtype"] = written["dtype"] = dtype
    return written


def tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model dir holds, in writing order, with its `[out, in]` shape."""
    return weight_shapes(config)


def stored_shapes(config: ModelConfig,
                  quantized: Mapping[str, QuantParams]) -> dict[str, tuple[int, ...]]:
    """`tensor_shapes` with the weight of each module in `quantized` replaced by the packed
    tensors `mx.quantize` makes of it."""
    shapes: dict[str, tuple[int, ...]] = {}
    for name, shape in tensor_shapes(config).items():
        module, _, kind = name.rpartition(".")
        if kind != "weight" or module not in quantized:
            shapes[name] = shape
            continue
        packed = quantized[module].packed_shapes(shape)
        shapes.update({f"{module}.{part}": packed[part] for part in packed})
    return shapes


def check_tensors(found: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]]) -> None:
    """Raise ValueError unless `found` has exactly the expected names and shapes."""
    missing = [n for n in expected if n not in found]
    extra = [n for n in found if n not in expected]
    if missing or extra:
        raise ValueError(
            "the checkpoint does not match the layout its config describes: "
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
