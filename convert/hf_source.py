"""Open a Hugging Face model dir (config.json + safetensors + tokenizer files) as a ModelSource.

Tensors pass through unchanged (the model classes use the Hugging Face names and layouts),
except MoE experts, which are stacked (see convert.expert_stacking), GPT-OSS's MXFP4 ones,
which stay packed (see convert.mxfp4_experts), Qwen3-Next's fused projections, which are split,
tensors a family keeps beside another module than the one using them (Laguna's router bias:
`metal_engine.loading.weights.moved_name`), and float dirs in mlx-lm's hybrid layout, which are
read back into Hugging Face's (metal_engine.loading.weights.to_this_layout).

A Qwen vision tower (Qwen3.5's, Qwen3-VL's) is kept unless `text_only`: under Hugging Face's
names (`model.visual.*`, also from mlx-vlm's `vision_tower.*`, its conv weight laid back out),
float, beside the image processor's preprocessor_config.json, its `vision_config` and image
token ids written into config.json (metal_engine.vision loads it). So is a Gemma 3 / Gemma 4
tower (`model.vision_tower.*`, `model.multi_modal_projector.*`, `model.embed_vision.*`, also
from mlx-vlm's names, Gemma 3's patch convolution laid back out) whose tensors are the float
tower's; one missing some is left out with a warning, the model converted as a text model.
A dir in MLX's quantized layout (mlx-vlm's quantized ones too) is not converted at all
(convert.layout.config_from_hf): it is served as it is, its tower dequantized at load.

Qwen3.5's multi-token-prediction head (`mtp.*`, which transformers drops on load) is kept for
speculative decoding (metal_engine.drafting.mtp): under its own names, laid out as the
decoder layers are (experts stacked), and never quantized (metal_engine.drafting.mtp loads
it as float: one layer). So is DeepSeek V3's and GLM-4.7-Flash's, the layer after the stack
(`model.layers.{num_hidden_layers}.*`): moved under `mtp.*` as their head class names it
(`_mtp_name`), the count written as `mtp_num_hidden_layers`.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import mlx.core as mx
from safetensors import safe_open

from convert.expert_stacking import stack_experts, stacked_shapes
from convert.fp8_weights import SCALE_SUFFIX, dequantize_fp8, fp8_block
from convert.fused_projections import unfuse, unfused_shapes
from convert.layout import IGNORED_SUFFIXES, check_tensors, config_from_hf, stored_shapes
from convert.mxfp4_experts import packed_modules, relaid_shapes, relay_tensors
from convert.source import ModelSource
from convert.tokenizer_files import copy_hf_tokenizer
from metal_engine.loading.model_config import ModelConfig
from metal_engine.loading.pooling_config import sentence_transformers_files
from metal_engine.loading.text_part import TEXT_PARTS, text_part_config
from metal_engine.loading.weights import (
    GEMMA_TOWER_PREFIXES,
    MTP_PREFIX,
    TOWER_PREFIXES,
    from_mlx_lm_hybrid,
    is_mlx_lm_hybrid,
    moved_name,
    safetensors_files,
    text_model_name,
)
from metal_engine.models.bert import checkpoint_name
from metal_engine.vision import gemma_config
from metal_engine.vision.gemma_loading import (
    PATCH_EMBED,
    conv_as_torch,
    conv_shape_as_torch,
    converted_tower_name,
    converted_tower_shapes,
)
from metal_engine.vision.pixels import IMAGE_PROCESSOR_CONFIG, PROCESSOR_CONFIG
from metal_engine.vision.qwen_vision_config import (
    QwenVisionConfig,
    read_vision_config,
    tower_config_entries,
)
from metal_engine.vision.qwen_vision_loading import (
    HF_PATCH_EMBED,
    conv_as_hf,
    conv_shape_as_hf,
    hf_tower_shapes,
    tower_name,
)

log = logging.getLogger("metal_serve")
INDEX_FILE = "model.safetensors.index.json"
# The tensors of a checkpoint saved from the base model (transformers' Qwen3Model) lack the
# causal LM's `model.` prefix.
BASE_MODEL_PARTS = ("embed_tokens.", "layers.", "norm.")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
# Gemma 3's patch convolution as a converted dir keeps it (mlx-vlm's is laid out channel-last).
GEMMA_PATCH_EMBED = "model." + PATCH_EMBED
# Families whose multi-token-prediction layer follows the stack (`model.layers.{N}.*`) and has
# a head class here (metal_engine.models.deepseek_v3.MultiTokenPredictor).
MTP_AFTER_THE_STACK = ("deepseek_v3", "glm4_moe_lite")
# The MTP layer's parts as that head names them; its `embed_tokens` and `shared_head.head` are
# the model's own again (dropped).
_MTP_PARTS = {"enorm.": "enorm.", "hnorm.": "hnorm.", "eh_proj.": "eh_proj.",
              "shared_head.norm.": "norm.", "self_attn.": "layers.0.self_attn.",
              "mlp.": "layers.0.mlp.", "input_layernorm.": "layers.0.input_layernorm.",
              "post_attention_layernorm.": "layers.0.post_attention_layernorm."}


def open_hf_dir(path: Path, text_only: bool = False) -> ModelSource:
    """Validate names and shapes of every tensor against config.json; load nothing yet.
    `text_only`: leave a vision tower out (it is kept by default)."""
    config_path = path / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(
            f"{path} has no config.json; the source must be a Hugging Face model dir "
            "or a .gguf file"
        )
    config = json.loads(config_path.read_text(encoding="utf-8"))
    model_config = config_from_hf(config)
    files = _weight_files(path)
    tower = None if text_only else read_vision_config(config)
    gemma = None if text_only else gemma_config.read_gemma_vision(config)
    names_by_file = _tensor_names(files, model_config,
                                  text_part=config.get("model_type") in TEXT_PARTS,
                                  keep_tower=tower is not None or gemma is not None,
                                  gemma=gemma_config.gemma_family(config) is not None)
    if gemma is not None and not _keeps_gemma_tower(names_by_file, gemma, path):
        gemma = None
    fp8_scales = _fp8_scales(names_by_file, fp8_block(config))
    found = {target: shape for names in names_by_file.values()
             for target, shape in names.values()}
    mlx_lm = model_config.linear_attention is not None and is_mlx_lm_hybrid(found)
    quantized = packed_modules(list(found))
    laid_out = unfused_shapes(model_config, stacked_shapes(
        model_config, relaid_shapes(_hf_shapes(found) if mlx_lm else found)))
    extra = {n: shape for n, shape in laid_out.items()
             if n.startswith((MTP_PREFIX, *TOWER_PREFIXES))}
    expected = stored_shapes(model_config, quantized)
    if not any(n.startswith("lm_head.") for n in laid_out):  # an embedding model's base model
        expected = {n: shape for n, shape in expected.items() if not n.startswith("lm_head.")}
    check_tensors({n: shape for n, shape in laid_out.items() if n not in extra}, expected)
    base_config = dict(text_part_config(config))  # a multimodal config's text model
    base_config.pop("quantization_config", None)  # how the source stored it, not the output
    mtp = any(n.startswith(MTP_PREFIX) for n in extra)
    if mtp and model_config.model_type in MTP_AFTER_THE_STACK:  # the one layer kept
        base_config["mtp_num_hidden_layers"] = 1
    tower_shapes = {n: shape for n, shape in extra.items() if n.startswith(TOWER_PREFIXES)}
    base_config = _with_tower_entries(base_config, config, tower, tower_shapes)
    if gemma is not None:
        base_config.update(gemma_config.tower_config_entries(config))
    return ModelSource(
        kind="hf",
        path=path,
        config=model_config,
        base_config=base_config,
        tensors=lambda: unfuse(model_config, stack_experts(
            model_config, relay_tensors(_read_tensors(names_by_file, mlx_lm, fp8_scales)))),
        write_tokenizer=partial(_copy_side_files, path, bool(tower_shapes)),
        files=(config_path, *files),
        quantized=quantized,
        extra_shapes=extra,
    )


def _weight_files(path: Path) -> list[Path]:
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{INDEX_FILE} names shards missing from {path}: {missing}")
        return files
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    return safetensors_files(path)  # refuses a dir of pickle checkpoints


def _with_tower_entries(base_config: dict[str, Any], config: dict[str, Any],
                        tower: QwenVisionConfig | None,
                        tower_shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """`base_config` describing the kept tower, whose tensors are checked against it, or no
    tower (mlx-lm's dirs keep the vision_config without the tower; a converted dir converted
    again `text_only` would)."""
    entries = {**tower_config_entries(config), **gemma_config.tower_config_entries(config)}
    if tower is None or not tower_shapes:
        return {k: v for k, v in base_config.items() if k not in entries}
    check_tensors(tower_shapes, hf_tower_shapes(tower))
    return {**base_config, **entries}


def _keeps_gemma_tower(names_by_file: dict[Path, dict[str, tuple[str, tuple[int, ...]]]],
                       config: gemma_config.Gemma3VisionConfig | gemma_config.Gemma4VisionConfig,
                       path: Path) -> bool:
    """Whether the source holds the float Gemma tower, its tensors kept for it (those it has
    no use for dropped); if not, every tower tensor is dropped."""
    wanted = converted_tower_shapes(config)
    found = {}
    for names in names_by_file.values():
        for source, (target, shape) in list(names.items()):
            if target.startswith(GEMMA_TOWER_PREFIXES):
                if target in wanted:
                    found[target] = shape
                else:
                    del names[source]
    if found == wanted:
        return True
    log.warning("%s: the vision tower's tensors are not the float %s tower's (some are "
                "missing or of other shapes); it is left out and the model converted as a "
                "text model", path,
                config.__class__.__name__.removesuffix("VisionConfig"))
    for names in names_by_file.values():
        for source in [s for s, (t, _) in names.items() if t.startswith(GEMMA_TOWER_PREFIXES)]:
            del names[source]
    return False


def _copy_side_files(source: Path, keep_tower: bool, out: Path) -> None:
    """The tokenizer files, how an embedding model pools (sentence-transformers' files), and
    the image processor's config beside a kept tower."""
    copy_hf_tokenizer(source, out)
    for name in sentence_transformers_files(source):
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source / name, out / name)
    for name in (PROCESSOR_CONFIG, IMAGE_PROCESSOR_CONFIG) if keep_tower else ():
        if (source / name).is_file():
            shutil.copy2(source / name, out / name)


def _tensor_names(files: list[Path], config: ModelConfig, text_part: bool, keep_tower: bool,
                  gemma: bool = False) -> dict[Path, dict[str, tuple[str, tuple[int, ...]]]]:
    """Per file, the tensors to convert: source name -> (name here, shape), read from the
    headers only. `text_part`: a multimodal checkpoint, of which the text model is kept, and
    with `keep_tower` its vision tower (a Qwen one under Hugging Face's names and conv layout;
    `gemma`'s under `model.`)."""
    towers = converted_tower_name if gemma else tower_name
    names_by_file: dict[Path, dict[str, tuple[str, tuple[int, ...]]]] = {}
    seen: set[str] = set()
    tied, layers = config.tie_word_embeddings, config.num_hidden_layers
    for file in files:
        with safe_open(file, framework="numpy") as handle:
            shapes = {n: tuple(handle.get_slice(n).get_shape()) for n in handle.keys()}  # noqa: SIM118  (a file handle, not a dict)
        targets = {n: _target_name(n, text_part, keep_tower, towers) for n in shapes}
        targets = {n: moved_name(config.model_type, t) for n, t in targets.items()
                   if t is not None}
        if config.encoder is not None:  # a cross-encoder's prefix off, what it never runs out
            targets = {n: checkpoint_name(t, config) for n, t in targets.items()}
        if config.model_type in MTP_AFTER_THE_STACK:
            targets = {n: _mtp_name(t, layers) for n, t in targets.items()}
        # Tied checkpoints sometimes store lm_head too; it is the embedding again.
        names = {n: (t, _torch_shape(t, shapes[n])) for n, t in targets.items()
                 if t is not None and not t.endswith(IGNORED_SUFFIXES)
                 and not (tied and t == "lm_head.weight") and not _beyond_the_stack(t, layers)}
        duplicates = seen.intersection(names)
        if duplicates:
            raise ValueError(f"tensors stored in more than one file: {sorted(duplicates)[:4]}")
        seen.update(names)
        names_by_file[file] = names
    return names_by_file


def _target_name(name: str, text_part: bool, keep_tower: bool,
                 towers: Callable[[str], str | None]) -> str | None:
    """A source tensor's name here: a vision tower's as `towers` names it (None unless kept),
    a multimodal checkpoint's text model's as the text model names it."""
    tower = towers(name)
    if tower is not None:
        return tower if keep_tower else None
    if name.startswith(BASE_MODEL_PARTS):  # saved from the base model, as embedding models are
        return f"model.{name}"
    return text_model_name(name) if text_part else name


def _torch_shape(target: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A tower's patch convolution's shape in PyTorch's layout (mlx-vlm's is MLX's)."""
    if target == HF_PATCH_EMBED:
        return conv_shape_as_hf(shape)
    return conv_shape_as_torch(shape) if target == GEMMA_PATCH_EMBED else shape


def _torch_layout(target: str, tensor: mx.array) -> mx.array:
    if target == HF_PATCH_EMBED:
        return conv_as_hf(tensor)
    return conv_as_torch(tensor) if target == GEMMA_PATCH_EMBED else tensor


def _hf_shapes(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """mlx-lm's hybrid shapes as Hugging Face's: its convs `[C, K, 1]` are `[C, 1, K]`."""
    return {n: (s[0], s[2], s[1]) if n.endswith("conv1d.weight") else s
            for n, s in shapes.items()}


def _beyond_the_stack(name: str, layers: int) -> bool:
    """A layer past num_hidden_layers: GLM-4.5's multi-token-prediction layers, which
    transformers does not run either."""
    match = _LAYER.match(name)
    return match is not None and int(match[1]) >= layers


def _mtp_name(name: str | None, layers: int) -> str | None:
    """The name here of a tensor of the first layer after the stack (the MTP layer): under
    `mtp.*` as the head names it, None for the model's embedding and head it repeats; other
    names as they are (further MTP layers are dropped as beyond the stack)."""
    prefix = f"model.layers.{layers}."
    if name is None or not name.startswith(prefix):
        return name
    part = name.removeprefix(prefix)
    for source, target in _MTP_PARTS.items():
        if part.startswith(source):
            return MTP_PREFIX + target + part.removeprefix(source)
    return None  # embed_tokens, shared_head.head


def _fp8_scales(names_by_file: dict[Path, dict[str, tuple[str, tuple[int, ...]]]],
               block: tuple[int, int] | None) -> _Fp8Scales | None:
    """An FP8 checkpoint's scales (convert.fp8_weights), taken out of the tensors to convert:
    by the weight they scale, the file and name they are stored under."""
    if block is None:
        return None
    scales = {}
    for file, names in names_by_file.items():
        for source in [n for n in names if n.endswith(SCALE_SUFFIX)]:
            target, _ = names.pop(source)
            scales[target.removesuffix(SCALE_SUFFIX) + ".weight"] = (file, source)
    return _Fp8Scales(block, scales)


class _Fp8Scales(NamedTuple):
    block: tuple[int, int]
    by_weight: dict[str, tuple[Path, str]]

    def dequantized(self, name: str, tensor: mx.array) -> mx.array:
        if name not in self.by_weight:
            return tensor
        file, source = self.by_weight[name]
        return dequantize_fp8(tensor, mx.load(str(file))[source], self.block)


def _read_tensors(names_by_file: dict[Path, dict[str, tuple[str, tuple[int, ...]]]],
                  mlx_lm: bool, fp8: _Fp8Scales | None = None) -> Iterator[tuple[str, mx.array]]:
    for file, names in names_by_file.items():
        # mx.load is lazy and reads bfloat16, which numpy cannot represent.
        weights = mx.load(str(file))
        for source, (target, _) in names.items():
            tensor = from_mlx_lm_hybrid(target, weights[source]) if mlx_lm else weights[source]
            tensor = _torch_layout(target, tensor)
            yield target, tensor if fp8 is None else fp8.dequantized(target, tensor)
