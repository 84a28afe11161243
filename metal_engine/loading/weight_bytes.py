"""What a model dir's weights take once loaded, read without loading them: from config.json,
and for a quantized checkpoint from its safetensors headers (`metal-serve serve`'s memory
check before loading, `--dry-run`)."""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import mlx.core as mx

from metal_engine.loading.model_config import ModelConfig, read_config_json
from metal_engine.loading.quantization import QuantizationConfig
from metal_engine.loading.text_part import TEXT_PARTS
from metal_engine.loading.weights import (
    MTP_PREFIX,
    TOWER_PREFIXES,
    keeps_quantized,
    safetensors_files,
    text_model_name,
    weight_shapes,
)

if TYPE_CHECKING:
    from metal_engine.config import EngineConfig

# safetensors dtypes -> bytes per element (float ones are cast to the run dtype at load).
_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}
_STORED_SIZES = {"I64": 8, "U64": 8, "I32": 4, "U32": 4, "I16": 2, "U16": 2, "I8": 1, "U8": 1,
                 "BOOL": 1}
TensorInfo = tuple[str, tuple[int, ...]]  # (safetensors dtype, shape)


def weight_bytes(config: ModelConfig, dtype: mx.Dtype,
                 quantized: Mapping[str, TensorInfo] | None = None,
                 multimodal: bool = False) -> int:
    """Bytes a model of `config` takes once loaded as `dtype`, without loading it: float
    weights are cast to `dtype` (load_model); a quantized checkpoint's weights (`quantized`:
    its safetensors entries) stay packed where the backend keeps them quantized, and are
    dequantized to `dtype` on the CPU backend. `multimodal`: the checkpoint also holds towers
    the text model does not load."""
    if quantized is None or not keeps_quantized():
        return sum(math.prod(shape) for shape in weight_shapes(config).values()) * dtype.size
    return sum(math.prod(shape) * (dtype.size if kind in _FLOAT_DTYPES else _STORED_SIZES[kind])
               for name, (kind, shape) in quantized.items() if _loaded(name, multimodal))


def _loaded(name: str, multimodal: bool) -> bool:
    """Whether load_model keeps tensor `name` (not a vision tower's, not the MTP head's)."""
    text_name = text_model_name(name) if multimodal else name
    return text_name is not None and not text_name.startswith((MTP_PREFIX, *TOWER_PREFIXES))


def model_dir_weight_bytes(model_dir: Path, dtype: mx.Dtype) -> tuple[ModelConfig, int]:
    """A model dir's config and `weight_bytes`, from config.json and the safetensors headers."""
    raw = read_config_json(model_dir)
    config = ModelConfig.from_dict(raw)
    if QuantizationConfig.from_config(raw) is None:
        return config, weight_bytes(config, dtype)
    headers = safetensors_headers(safetensors_files(model_dir))
    return config, weight_bytes(config, dtype, headers, raw.get("model_type") in TEXT_PARTS)


def safetensors_headers(files: list[Path]) -> dict[str, TensorInfo]:
    """Every tensor's dtype and shape, from the files' JSON headers (no tensor is read)."""
    tensors: dict[str, TensorInfo] = {}
    for path in files:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        tensors.update((name, (entry["dtype"], tuple(entry["shape"])))
                       for name, entry in header.items() if name != "__metadata__")
    return tensors


def drafter_weight_bytes(config: EngineConfig, dtype: mx.Dtype) -> int:
    """Bytes the weights speculative decoding drafts with take once loaded: a draft model's,
    or the MTP head's (float, `dtype`); 0 for the host's methods or a dir not there.
    `auto` must be resolved first (metal_engine.drafting.auto)."""
    spec = config.speculative_config
    if spec is None or spec.method not in ("draft_model", "mtp"):
        return 0
    path = Path(spec.model or config.model_dir)
    if not (path / "config.json").is_file():
        return 0  # loading it names what is missing
    if spec.method == "draft_model":
        return model_dir_weight_bytes(path, dtype)[1]
    headers = safetensors_headers(safetensors_files(path))
    return sum(math.prod(shape) for name, (_, shape) in headers.items()
               if name.startswith(MTP_PREFIX)) * dtype.size
