"""Build a model from a model dir: config.json + safetensors (sharded or not), in float or in
MLX's quantized layout (see metal_engine.quantization)."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import TypeVar

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from metal_engine.model_config import ModelConfig, read_config_json
from metal_engine.models.decoder import CausalLM
from metal_engine.models.registry import model_class
from metal_engine.quantization import QuantizationConfig, dequantize_weights

log = logging.getLogger("metal_serve")
PICKLE_PATTERNS = ("*.bin", "*.pt", "*.pth")
T = TypeVar("T")
_PER_EXPERT = re.compile(
    r"^(?P<block>.+)\.experts\.(?P<expert>\d+)\.(?P<proj>\w+)\.(?P<kind>weight|scales|biases)$")
# Mixtral's projection names -> the stacked layout's.
_PROJECTIONS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def resolve_dtype(name: str) -> mx.Dtype:
    if name == "auto":
        return mx.float16 if mx.metal.is_available() else mx.float32
    return getattr(mx, name)


def safetensors_files(model_dir: Path) -> list[Path]:
    """The dir's *.safetensors files; a dir with only pickle checkpoints is refused."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if files:
        return files
    if any(any(Path(model_dir).glob(pattern)) for pattern in PICKLE_PATTERNS):
        raise ValueError(
            f"{model_dir} has only pickle checkpoints (*.bin/*.pt), which can run code when "
            "loaded, so metal-serve never reads them. Re-save the model as safetensors "
            "(transformers: model.save_pretrained(dir, safe_serialization=True)), then "
            "`metal-serve convert DIR --out OUT`"
        )
    raise FileNotFoundError(
        f"no *.safetensors in {model_dir}: convert the model first with "
        "`metal-serve convert <source> --out DIR`"
    )


def keeps_quantized() -> bool:
    """Quantized layers run as such off the CPU. MLX's CPU quantized matmul runs at about
    1.5 GFLOP/s, far below its float32 BLAS matmul, so the CPU backend dequantizes at load."""
    return mx.default_device() != mx.cpu


def load_model(model_dir: Path, dtype: mx.Dtype) -> CausalLM:
    """Instantiate the config's model class and load every weight; missing or unexpected names
    are errors. Quantized checkpoints keep quantized layers, or are dequantized on the CPU."""
    raw_config = read_config_json(model_dir)
    config = ModelConfig.from_dict(raw_config)
    quantization = QuantizationConfig.from_config(raw_config)
    files = safetensors_files(model_dir)
    model = model_class(config.model_type)(config)
    weights: dict[str, mx.array] = {}
    for path in files:
        weights.update(mx.load(str(path)))
    if config.moe is not None:
        weights = stack_per_expert(weights, config.moe.num_experts)
    weights = model.sanitize(weights)
    if quantization is not None and keeps_quantized():
        nn.quantize(model, class_predicate=_quantized_modules(weights, quantization))
    elif quantization is not None:
        log.info("CPU backend: dequantizing the %d-bit %s weights of %s to %s at load (MLX's "
                 "CPU quantized matmul is slow)", quantization.default.bits,
                 quantization.default.mode, model_dir, dtype)
        weights = dequantize_weights(weights, quantization)
    # Packed weights (uint32) and mxfp4 scales (uint8) stay so; every float tensor takes `dtype`.
    weights = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v
               for k, v in weights.items()}
    model.load_weights(list(weights.items()), strict=True)
    model.eval()
    mx.eval(model.parameters())
    return model


def stack_per_expert(weights: dict[str, mx.array], num_experts: int) -> dict[str, mx.array]:
    """`weights` with one-tensor-per-expert sets stacked `[experts, ...]` under `switch_mlp`, as
    the models name them. Early mlx-community MoE checkpoints (Mixtral's, written before mlx-lm
    stacked experts) store them so, quantized with each expert's scales and biases; stacking
    those equals quantizing the stack."""
    others, sets = expert_sets(weights, num_experts)
    return {**others, **{name: mx.stack(values) for name, values in sets.items()}}


def expert_sets(items: dict[str, T], num_experts: int) -> tuple[dict[str, T], dict[str, list[T]]]:
    """(the items that are no expert's, per stacked name its experts' items in expert order);
    a set without exactly experts 0..num_experts-1 is an error naming it."""
    others: dict[str, T] = {}
    sets: dict[str, dict[int, T]] = {}
    for name, value in items.items():
        target = stacked_expert_name(name)
        if target is None:
            others[name] = value
        else:
            sets.setdefault(target[0], {})[target[1]] = value
    for name, by_expert in sets.items():
        if sorted(by_expert) != list(range(num_experts)):
            missing = sorted(set(range(num_experts)) - set(by_expert))
            raise ValueError(f"{name}: the checkpoint holds {len(by_expert)} experts' tensors "
                             f"(missing {missing[:4]}), its config.json says {num_experts}")
    return others, {name: [s[e] for e in range(num_experts)] for name, s in sets.items()}


def stacked_expert_name(name: str) -> tuple[str, int] | None:
    """(name in the stacked layout, expert index) of a per-expert tensor name, else None:
    `...experts.7.w1.weight` -> (`...switch_mlp.gate_proj.weight`, 7)."""
    match = _PER_EXPERT.match(name)
    if match is None:
        return None
    proj = _PROJECTIONS.get(match["proj"], match["proj"])
    return f"{match['block']}.switch_mlp.{proj}.{match['kind']}", int(match["expert"])


def _quantized_modules(weights: dict[str, mx.array], quantization: QuantizationConfig):
    """nn.quantize's predicate, mlx-lm's rule: a module is quantized iff the checkpoint has its
    scales; it gets its own per-module params where the config lists them."""

    def predicate(path: str, module: nn.Module) -> bool | dict[str, int]:
        if not hasattr(module, "to_quantized") or f"{path}.scales" not in weights:
            return False
        return quantization.params_for(path).to_dict()

    return predicate


def weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight a model dir of `config` holds (Hugging Face names, `[out, in]` shapes), in
    module order. Nothing is allocated: the model's initial weights stay lazy."""
    model = model_class(config.model_type)(config)
    return {name: tuple(value.shape) for name, value in tree_flatten(model.parameters())}


def parameter_bytes(model: nn.Module) -> int:
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))
