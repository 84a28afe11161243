"""Quantize tensors while writing a model dir, in the layout mlx-lm writes (see
metal_engine.quantization): every Linear and Embedding whose input width is a multiple of the
group size becomes `weight` (uint32, packed), `scales` and `biases`."""

from __future__ import annotations

from collections.abc import Iterator

import mlx.core as mx

from metal_engine.model_config import ModelConfig
from metal_engine.models.registry import model_class
from metal_engine.quantization import QuantParams


def quantizable_modules(config: ModelConfig, group_size: int) -> set[str]:
    """Module paths mlx-lm's `quantize_model` would quantize for this config."""
    model = model_class(config.model_type)(config)
    return {path for path, module in model.named_modules()
            if hasattr(module, "to_quantized") and module.weight.shape[-1] % group_size == 0}


class TensorQuantizer:
    """Turns each (name, float tensor) into the tensors a quantized model dir stores."""

    def __init__(self, config: ModelConfig, params: QuantParams, dtype: mx.Dtype) -> None:
        self.params, self.dtype = params, dtype
        self.modules = quantizable_modules(config, params.group_size)

    def __call__(self, name: str, tensor: mx.array) -> Iterator[tuple[str, mx.array]]:
        # Quantized from `dtype`, as mlx-lm quantizes a model loaded in that dtype.
        tensor = tensor.astype(self.dtype)
        module = name.removesuffix(".weight")
        if not name.endswith(".weight") or module not in self.modules:
            yield name, tensor
            return
        weight, scales, biases = mx.quantize(tensor, self.params.group_size, self.params.bits)
        yield name, weight
        yield f"{module}.scales", scales
        yield f"{module}.biases", biases

    def config_entries(self) -> dict[str, dict[str, int]]:
        """The config.json keys mlx-lm writes: `quantization`, repeated as `quantization_config`."""
        return {"quantization": self.params.to_dict(),
                "quantization_config": self.params.to_dict()}
