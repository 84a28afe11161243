"""Build a model from a model dir: config.json + safetensors (sharded or not)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from metal_engine.model_config import ModelConfig
from metal_engine.models.decoder import CausalLM
from metal_engine.models.registry import model_class


def resolve_dtype(name: str) -> mx.Dtype:
    if name == "auto":
        return mx.float16 if mx.metal.is_available() else mx.float32
    return getattr(mx, name)


def load_model(model_dir: Path, dtype: mx.Dtype) -> CausalLM:
    """Instantiate the config's model class and load every weight; missing or unexpected names
    are errors."""
    config = ModelConfig.from_model_dir(model_dir)
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors in {model_dir}: convert the model first with "
            "`metal-serve convert <source> --out DIR`"
        )
    model = model_class(config.model_type)(config)
    weights: dict[str, mx.array] = {}
    for path in files:
        weights.update(mx.load(str(path)))
    weights = {k: v.astype(dtype) for k, v in model.sanitize(weights).items()}
    model.load_weights(list(weights.items()), strict=True)
    model.eval()
    mx.eval(model.parameters())
    return model


def weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight a model dir of `config` holds (Hugging Face names, `[out, in]` shapes), in
    module order. Nothing is allocated: the model's initial weights stay lazy."""
    model = model_class(config.model_type)(config)
    return {name: tuple(value.shape) for name, value in tree_flatten(model.parameters())}


def parameter_bytes(model: nn.Module) -> int:
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))
