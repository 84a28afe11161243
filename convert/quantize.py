"""Quantize tensors while writing a model dir, in the layout mlx-lm writes (see
metal_engine.loading.quantization): every Linear, Embedding and stacked-expert layer whose
input width is a multiple of the group size becomes `weight` (uint32, packed), `scales` and
`biases`.

mlx-lm keeps some modules at other params (its models' `quant_predicate`) and lists those in
config.json; FAMILY_MODULE_PARAMS holds the ones of the families converted here. A source whose
experts come quantized already (GPT-OSS's MXFP4) keeps them as they are.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import mlx.core as mx

from metal_engine.loading.model_config import ModelConfig
from metal_engine.loading.quantization import QuantParams
from metal_engine.models.registry import model_class

MODE = "affine"
# model_type -> (module path suffix, params) that mlx-lm quantizes differently. The routers of
# Qwen3-MoE, MiniMax M2, GPT-OSS and Gemma 4 stay at 8 bits: which experts a token picks is
# sensitive to rounding; so do Qwen3.5-MoE's and Qwen3-Next's, and their shared experts' gates.
_QWEN_HYBRID_GATES = (("mlp.gate", QuantParams(64, 8)), ("shared_expert_gate", QuantParams(64, 8)))
FAMILY_MODULE_PARAMS = {
    "qwen3_moe": (("mlp.gate", QuantParams(64, 8)),),
    "minimax_m2": (("block_sparse_moe.gate", QuantParams(64, 8)),),
    "gpt_oss": (("router", QuantParams(64, 8)),),
    "gemma4_text": (("router.proj", QuantParams(64, 8)),),
    "qwen3_5_moe_text": _QWEN_HYBRID_GATES,
    "qwen3_next": _QWEN_HYBRID_GATES,
}


def quantizable_modules(config: ModelConfig, group_size: int) -> list[str]:
    """Module paths mlx-lm's `quantize_model` would quantize for this config."""
    model = model_class(config.model_type)(config)
    # mlx-lm checks divisibility by the checkpoint-wide group size, also for special modules.
    return [path for path, module in model.named_modules()
            if hasattr(module, "to_quantized") and module.weight.shape[-1] % group_size == 0]


def special_params(config: ModelConfig, modules: list[str]) -> dict[str, QuantParams]:
    """The modules among `modules` that mlx-lm quantizes with other params, and those."""
    special = FAMILY_MODULE_PARAMS.get(config.model_type, ())
    return {path: params for path in modules
            for suffix, params in special if path.endswith(suffix)}


class TensorQuantizer:
    """Turns each (name, float tensor) into the tensors a quantized model dir stores; the
    `prequantized` modules' packed tensors pass through."""

    def __init__(self, config: ModelConfig, params: QuantParams, dtype: mx.Dtype,
                 prequantized: Mapping[str, QuantParams] | None = None) -> None:
        self.params, self.dtype = params, dtype
        modules = [path for path in quantizable_modules(config, params.group_size)
                   if path not in (prequantized or {})]
        self.modules, self.special = dict.fromkeys(modules), special_params(config, modules)

    def __call__(self, name: str, tensor: mx.array) -> Iterator[tuple[str, mx.array]]:
        if not mx.issubdtype(tensor.dtype, mx.floating):  # packed already
            yield name, tensor
            return
        # Quantized from `dtype`, as mlx-lm quantizes a model loaded in that dtype.
        tensor = tensor.astype(self.dtype)
        module = name.removesuffix(".weight")
        if not name.endswith(".weight") or module not in self.modules:
            yield name, tensor
            return
        params = self.special.get(module, self.params)
        # Stacked experts `[experts, out, in]` quantize as each expert's matrix would.
        weight, scales, biases = mx.quantize(tensor, params.group_size, params.bits, mode=MODE)
        yield name, weight
        yield f"{module}.scales", scales
        yield f"{module}.biases", biases

    def config_entries(self) -> dict[str, dict[str, int | str | dict[str, int]]]:
        """The config.json keys mlx-lm writes: `quantization` (the checkpoint-wide params, the
        mode, and each module quantized otherwise), repeated as `quantization_config`."""
        entries: dict[str, int | str | dict[str, int]] = {**self.params.to_dict(), "mode": MODE}
        entries.update({path: params.to_dict() for path, params in self.special.items()})
        return {"quantization": entries, "quantization_config": dict(entries)}

    def module_entries(self) -> dict[str, dict[str, int | str]]:
        """Every module quantized here with its params, as mlx-lm lists them when the
        checkpoint came quantized already: its `quant_predicate`'s own, else with the mode."""
        return {path: self.special[path].to_dict() if path in self.special
                else {**self.params.to_dict(), "mode": MODE} for path in self.modules}


def quantization_entries(quantizer: TensorQuantizer | None,
                         prequantized: Mapping[str, QuantParams]) -> dict[str, dict]:
    """config.json's quantization keys for a dir written with `quantizer` (or none) from a
    source whose `prequantized` modules came packed. Those share one set of params, which
    becomes the checkpoint-wide one, as mlx-lm records GPT-OSS's MXFP4 experts; the modules
    quantized here are then listed one by one."""
    if not prequantized:
        return quantizer.config_entries() if quantizer else {}
    shared = set(prequantized.values())
    if len(shared) != 1:
        raise ValueError(f"the source's quantized modules differ in params ({shared}); "
                         "mlx-lm's layout records one set for them")
    entries: dict = {**shared.pop().to_dict(), **(quantizer.module_entries() if quantizer else {})}
    return {"quantization": entries, "quantization_config": dict(entries)}
