"""Build a model from a model dir: config.json + safetensors (sharded or not), in float or in
MLX's quantized layout (see metal_engine.loading.quantization), with Hugging Face's tensor names or
mlx-lm's (`to_this_layout`)."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from metal_engine.loading.mla_layout import join_kv_b_proj
from metal_engine.loading.model_config import ModelConfig, read_config_json
from metal_engine.loading.quantization import QuantizationConfig, QuantParams, dequantize_weights
from metal_engine.loading.text_part import TEXT_PARTS
from metal_engine.models.decoder import CausalLM
from metal_engine.models.linear_attention_config import GatedDeltaNetConfig
from metal_engine.models.registry import model_class

log = logging.getLogger("metal_serve")
PICKLE_PATTERNS = ("*.bin", "*.pt", "*.pth")
T = TypeVar("T")
_PER_EXPERT = re.compile(
    r"^(?P<block>.+)\.experts\.(?P<expert>\d+)\.(?P<proj>\w+)\.(?P<kind>weight|scales|biases)$")
# Mixtral's projection names -> the stacked layout's.
_PROJECTIONS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
# Qwen3.5's and Qwen3-Next's multi-token-prediction head: kept in model dirs, loaded apart by
# speculative decoding's `mtp` method (metal_engine.drafting.mtp).
MTP_PREFIX = "mtp."
# A converted dir keeps a Qwen vision tower under Hugging Face's names; metal_engine.vision
# loads it, the text model skips it.
TOWER_PREFIX = "model.visual."
# Gemma's tower parts as a converted dir keeps them; every tower a converted dir keeps.
GEMMA_TOWER_PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.",
                        "model.embed_vision.")
TOWER_PREFIXES = (TOWER_PREFIX, *GEMMA_TOWER_PREFIXES)
# Where a multimodal checkpoint keeps its text model: Hugging Face's prefix, mlx-lm's two
# (also Kimi K2.5's own), and Kimi K2.5's as transformers saves it: its load renames the
# vision tower's `blocks` to `layers`, and its save turns every `layers` back to `blocks`.
_TEXT_PREFIXES = {"model.language_model.": "model.",
                  "language_model.model.blocks.": "model.layers.",
                  "language_model.model.": "model.",
                  "language_model.lm_head.": "lm_head.", "lm_head.": "lm_head."}
# The Qwen3.5 / Qwen3-Next norms that scale by `1 + w`: mlx-lm stores them with the 1 added.
_MLX_LM_SHIFTED_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight",
                         "model.norm.weight", ".q_norm.weight", ".k_norm.weight")
# Tensors a family's checkpoints keep beside another module than the one that uses them, moved
# there as transformers moves them at load: Laguna's choice bias, stored with its experts, is
# its router's.
_MOVED = {"laguna": {".mlp.experts.e_score_correction_bias": ".mlp.gate.e_score_correction_bias"}}
# Qwen3-Next's fused projection -> the ones it splits into (see `split_fused`).
FUSED_PROJECTIONS = {"in_proj_qkvz": ("in_proj_qkv", "in_proj_z"),
                     "in_proj_ba": ("in_proj_b", "in_proj_a")}


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


# Experts fused into one tensor per projection, as transformers saves GPT-OSS, Gemma 4,
# Mistral 4 and others: `metal-serve convert` splits them (convert/expert_stacking.py).
_FUSED_EXPERTS = re.compile(r".+\.experts\.(gate_up_proj|down_proj)(_bias)?")


def _refuse_fused_experts(model_dir: Path, weights: dict[str, mx.array]) -> None:
    fused = sorted(name for name in weights if _FUSED_EXPERTS.fullmatch(name))
    if fused:
        raise ValueError(
            f"{model_dir} keeps each layer's experts fused in one tensor ({fused[0]}), as "
            f"transformers saves them; convert it first with `metal-serve convert "
            f"{model_dir} --out DIR` (it splits them) and serve DIR"
        )


def keeps_quantized() -> bool:
    """Quantized layers run as such off the CPU. MLX's CPU quantized matmul runs at about
    1.5 GFLOP/s, far below its float32 BLAS matmul, so the CPU backend dequantizes at load."""
    return mx.default_device() != mx.cpu


def load_model(model_dir: Path, dtype: mx.Dtype,
               shard: Callable[[CausalLM], object] | None = None) -> CausalLM:
    """Instantiate the config's model class and load every weight; missing or unexpected names
    are errors. Quantized checkpoints keep quantized layers, or are dequantized on the CPU.
    `shard` (tensor parallelism) keeps a rank's share of the weights before they are read, so
    a rank never holds the whole model."""
    raw_config = read_config_json(model_dir)
    config = ModelConfig.from_dict(raw_config)
    quantization = QuantizationConfig.from_config(raw_config)
    files = safetensors_files(model_dir)
    model = model_class(config.model_type)(config)
    weights: dict[str, mx.array] = {}
    for path in files:
        weights.update(mx.load(str(path)))
    multimodal = raw_config.get("model_type") in TEXT_PARTS
    weights = to_this_layout(with_model_prefix(weights), config, multimodal)
    _refuse_fused_experts(model_dir, weights)
    if not has_lm_head(config, weights):
        model.drop_head()  # an embedding model's base-model checkpoint
    if quantization is not None:
        quantization = this_layout_entries(quantization, multimodal)
    weights = join_kv_b_proj(weights, config, quantization)
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
    del weights
    if shard is not None:
        shard(model)
    model.eval()
    mx.eval(model.parameters())
    return model


def has_lm_head(config: ModelConfig, names: Iterable[str]) -> bool:
    """Whether a decoder whose checkpoint holds tensors `names` (this layout's) has an LM head:
    tied to its embedding, or its own (a base model's checkpoint, an embedding model's, has
    none)."""
    return config.tie_word_embeddings or any(name.startswith("lm_head.") for name in names)


def with_model_prefix(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """A checkpoint saved from the base model (transformers' `Qwen3Model`, as embedding
    models are) names its tensors without the causal LM's `model.` prefix: add it."""
    if "embed_tokens.weight" not in weights or any(k.startswith("model.") for k in weights):
        return weights
    return {f"model.{k}": v for k, v in weights.items()}


def to_this_layout(weights: dict[str, mx.array], config: ModelConfig,
                   multimodal: bool) -> dict[str, mx.array]:
    """`weights` under the names and layouts the model classes load. What mlx-lm writes for the
    hybrid families differs: a multimodal wrapper's text model sits under `language_model.`
    beside its vision tower, conv1d weights are MLX's `[C, K, 1]`, some norms carry `1 + w`,
    and Qwen3-Next's fused projections stay fused (also quantized). The multi-token-prediction
    head (`mtp.*`) is set aside: metal_engine.drafting.mtp loads it; so is a converted dir's
    vision tower (`TOWER_PREFIXES`: metal_engine.vision)."""
    if multimodal:
        weights = {target: v for n, v in weights.items()
                   if (target := text_model_name(n)) is not None}
    weights = {moved_name(config.model_type, n): v for n, v in weights.items()
               if not n.startswith((MTP_PREFIX, *TOWER_PREFIXES))}
    if config.linear_attention is None:
        return weights
    if is_mlx_lm_hybrid({n: tuple(v.shape) for n, v in weights.items()}):
        weights = {n: from_mlx_lm_hybrid(n, v) for n, v in weights.items()}
    return {new: part for n, v in weights.items()
            for new, part in split_fused(n, v, config.linear_attention)}


def text_model_name(name: str) -> str | None:
    """A multimodal checkpoint's tensor name as its text model's (`model.language_model.x`,
    and mlx-lm's `language_model.model.x`, are `model.x`); `mtp.*` as it is; None for the
    other parts' tensors (vision and audio towers, their projections)."""
    if name.startswith(MTP_PREFIX):
        return name
    prefix = next((p for p in _TEXT_PREFIXES if name.startswith(p)), None)
    return None if prefix is None else _TEXT_PREFIXES[prefix] + name.removeprefix(prefix)


def moved_name(model_type: str, name: str) -> str:
    """`name` where the family's model keeps that tensor (see `_MOVED`)."""
    for stored, used in _MOVED.get(model_type, {}).items():
        if name.endswith(stored):
            return name.removesuffix(stored) + used
    return name


def is_mlx_lm_hybrid(shapes: dict[str, tuple[int, ...]]) -> bool:
    """Whether the checkpoint's conv1d weights are in MLX's `[C, K, 1]` layout, as mlx-lm
    writes Qwen3.5 and Qwen3-Next (Hugging Face's are `[C, 1, K]`); its norms are then shifted
    as mlx-lm's `sanitize` shifts them."""
    return any(name.endswith("conv1d.weight") and len(shape) == 3 and shape[2] == 1
               and shape[1] > 1 for name, shape in shapes.items())


def from_mlx_lm_hybrid(name: str, tensor: mx.array) -> mx.array:
    """One tensor of mlx-lm's hybrid layout in Hugging Face's: the conv as `[C, 1, K]`, the
    `1 + w` norms without the 1 (subtracted in float32: exact for the float16 and bfloat16
    sums mlx-lm stores)."""
    if name.endswith("conv1d.weight"):
        return tensor.swapaxes(1, 2)
    if name.endswith(_MLX_LM_SHIFTED_NORMS) and tensor.ndim == 1:
        return (tensor.astype(mx.float32) - 1).astype(tensor.dtype)
    return tensor


def split_fused(name: str, tensor: mx.array,
                cfg: GatedDeltaNetConfig) -> list[tuple[str, mx.array]]:
    """Qwen3-Next's fused `in_proj_qkvz` / `in_proj_ba` tensor (weight, or quantized weight,
    scales or biases) as Qwen3.5's projections' (`in_proj_qkv` + `in_proj_z`, `in_proj_b` +
    `in_proj_a`); any other tensor as it is. The fused rows are grouped by key head: its q, k,
    then the v and z of its `Hv // Hk` value heads (b then a). Rows split alone, so a
    quantized tensor splits as its float one would quantize."""
    module, _, kind = name.rpartition(".")
    owner, _, projection = module.rpartition(".")
    if projection not in FUSED_PROJECTIONS:
        return [(name, tensor)]
    first, second = (f"{owner}.{p}.{kind}" for p in FUSED_PROJECTIONS[projection])
    per_key, width = cfg.num_value_heads // cfg.num_key_heads, tensor.shape[-1]
    grouped = mx.array(tensor).reshape(cfg.num_key_heads, -1, width)  # GGUF's come as numpy
    if projection == "in_proj_ba":
        b, a = mx.split(grouped, 2, axis=1)
        return [(first, b.reshape(-1, width)), (second, a.reshape(-1, width))]
    dk, dv = cfg.key_head_dim, per_key * cfg.value_head_dim
    q, k, v, z = (x.reshape(-1, width)
                  for x in mx.split(grouped, [dk, 2 * dk, 2 * dk + dv], axis=1))
    return [(first, mx.concatenate([q, k, v])), (second, z)]


def this_layout_entries(quantization: QuantizationConfig,
                        multimodal: bool) -> QuantizationConfig:
    """The per-module quantization entries under the module paths `to_this_layout` gives:
    mlx-lm lists a multimodal model's as `language_model.model.*`, and a fused projection's
    params are its parts'."""
    modules: dict[str, QuantParams | bool] = {}
    for path, entry in quantization.modules.items():
        target = text_model_name(f"{path}.weight") if multimodal else f"{path}.weight"
        if target is None:
            continue
        owner, _, projection = target.removesuffix(".weight").rpartition(".")
        parts = FUSED_PROJECTIONS.get(projection, (projection,))
        modules.update({f"{owner}.{part}".lstrip("."): entry for part in parts})
    return QuantizationConfig(quantization.default, modules)


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
