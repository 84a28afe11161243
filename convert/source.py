"""What a model source hands the writer: config, a lazy tensor stream, and the tokenizer."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from metal_engine.loading.model_config import ModelConfig
from metal_engine.loading.quantization import QuantParams

if TYPE_CHECKING:
    import mlx.core as mx
    import numpy as np

    Tensor = np.ndarray | mx.array


@dataclass(frozen=True)
class ModelSource:
    """One opened source; nothing heavy is read until `tensors()` is iterated.

    `tensors()` yields (Hugging Face name, tensor in [out, in] layout) for every name in
    `tensor_shapes(config)`, each exactly once, except that the modules in `quantized` come
    already packed, as `stored_shapes(config, quantized)` names them (GPT-OSS's MXFP4 experts),
    and the `extra_shapes` tensors, which the model does not load but the dir keeps, in float
    (Qwen3.5's multi-token-prediction head, for speculative decoding; a Qwen vision tower).
    `write_tokenizer(dir)` writes the tokenizer files into dir (and the image processor's
    config beside a kept vision tower). `base_config` holds source
    config keys to keep (empty for GGUF); `files` are the source files the manifest
    fingerprints.
    """

    kind: Literal["gguf", "hf"]
    path: Path
    config: ModelConfig
    base_config: dict[str, Any]
    tensors: Callable[[], Iterator[tuple[str, Tensor]]]
    write_tokenizer: Callable[[Path], None]
    files: tuple[Path, ...]
    quantized: dict[str, QuantParams] = field(default_factory=dict)
    extra_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)


def fingerprint(files: tuple[Path, ...]) -> dict[str, dict[str, float]]:
    """Size and mtime per source file: enough to notice a changed source without hashing GBs."""
    return {f.name: {"size": f.stat().st_size, "mtime": f.stat().st_mtime} for f in files}
