"""The Qwen vision tower's weights from a model dir, in any of the layouts it comes in:

- Hugging Face's (`save_pretrained` of Qwen3VL/Qwen3_5ForConditionalGeneration, and the dirs
  `metal-serve convert` writes): `model.visual.*`, the patch embedding a Conv3d weight
  [hidden, C, T, P, P];
- mlx-vlm's (mlx-community): `vision_tower.*`, the conv weight channel-last
  [hidden, T, P, P, C], maybe quantized (then dequantized here: the tower runs in float).

The text model's loader skips these tensors (metal_engine.loading.weights).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from metal_engine.loading.model_config import read_config_json
from metal_engine.loading.quantization import QuantizationConfig, dequantize_weights
from metal_engine.loading.weights import TOWER_PREFIX, safetensors_files
from metal_engine.vision.qwen_vision import QwenVisionTower
from metal_engine.vision.qwen_vision_config import QwenVisionConfig, read_vision_config

TOWER_PREFIXES = (TOWER_PREFIX, "vision_tower.")
PATCH_EMBED = "patch_embed.proj.weight"
HF_PATCH_EMBED = TOWER_PREFIX + PATCH_EMBED


def tower_name(name: str) -> str | None:
    """A checkpoint tensor's name in Hugging Face's layout (`model.visual.x`) if it is the
    tower's, else None."""
    prefix = next((p for p in TOWER_PREFIXES if name.startswith(p)), None)
    return None if prefix is None else TOWER_PREFIX + name.removeprefix(prefix)


def conv_as_hf(weight: mx.array) -> mx.array:
    """The patch embedding's Conv3d weight as [hidden, C, T, P, P], from either layout."""
    return weight.moveaxis(4, 1) if is_channel_last(tuple(weight.shape)) else weight


def conv_shape_as_hf(shape: tuple[int, ...]) -> tuple[int, ...]:
    return (shape[0], shape[4], *shape[1:4]) if is_channel_last(shape) else shape


def is_channel_last(shape: tuple[int, ...]) -> bool:
    """Whether a Conv3d weight is MLX's [out, T, P, P, C] (mlx-vlm's) rather than PyTorch's
    [out, C, T, P, P]: a patch is square, so PyTorch's last two sides are equal."""
    return len(shape) == 5 and shape[3] != shape[4]


def hf_tower_shapes(cfg: QwenVisionConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the tower in Hugging Face's names and layout (nothing is allocated)."""
    shapes = {TOWER_PREFIX + n: tuple(v.shape)
              for n, v in tree_flatten(QwenVisionTower(cfg).parameters())}
    shapes[HF_PATCH_EMBED] = (cfg.hidden_size, cfg.in_channels, cfg.temporal_patch_size,
                              cfg.patch_size, cfg.patch_size)
    return shapes


def load_vision_tower(model_dir: Path, dtype: mx.Dtype) -> QwenVisionTower | None:
    """The model dir's Qwen vision tower with its weights in `dtype`; None when its config
    describes none or the dir holds none of its tensors (mlx-lm's conversions keep the
    vision_config and drop the tower). Missing or unexpected tower tensors are errors."""
    raw = read_config_json(model_dir)
    cfg = read_vision_config(raw)
    if cfg is None:
        return None
    weights = tower_weights(model_dir, QuantizationConfig.from_config(raw))
    if not weights:
        return None
    if PATCH_EMBED in weights:  # the conv as the product PatchEmbed computes
        weights[PATCH_EMBED] = conv_as_hf(weights[PATCH_EMBED]).reshape(
            cfg.hidden_size, cfg.patch_dim)
    tower = QwenVisionTower(cfg)
    tower.load_weights([(n, v.astype(dtype)) for n, v in weights.items()], strict=True)
    tower.eval()
    mx.eval(tower.parameters())
    return tower


def tower_weights(model_dir: Path,
                  quantization: QuantizationConfig | None) -> dict[str, mx.array]:
    """The tower's tensors under the module's own names (float: quantized ones dequantized),
    read lazily from the dir's safetensors."""
    stored = {}
    for path in safetensors_files(model_dir):
        stored.update({n: v for n, v in mx.load(str(path)).items() if tower_name(n)})
    if quantization is not None:
        stored = dequantize_weights(stored, quantization)
    return {tower_name(n).removeprefix(TOWER_PREFIX): v for n, v in stored.items()}
