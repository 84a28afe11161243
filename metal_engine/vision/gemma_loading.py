"""Load Gemma 3's or Gemma 4's vision tower from a model dir: a Hugging Face multimodal
checkpoint (`model.vision_tower.*` as transformers 5 saves Gemma 4, `vision_tower.*` and
`multi_modal_projector.*` as it saves Gemma 3, `vision_tower.vision_model.*` in Google's
Gemma 3 uploads) or mlx-vlm's (the same names without `model.`, Gemma 3's patch convolution
in MLX's `[out, p, p, channels]` layout, linears possibly quantized: dequantized here).

The text model's tensors are never read: metal_engine.loading.weights loads those.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from metal_engine.loading.model_config import read_config_json
from metal_engine.loading.quantization import QuantizationConfig, dequantize_weights
from metal_engine.loading.weights import safetensors_files
from metal_engine.vision.gemma3_vision import Gemma3VisionTower
from metal_engine.vision.gemma4_vision import Gemma4VisionTower
from metal_engine.vision.gemma_config import (
    Gemma3VisionConfig,
    Gemma4VisionConfig,
    read_gemma_vision,
)

GemmaVisionTower = Gemma3VisionTower | Gemma4VisionTower
_TOWER_PREFIXES = ("vision_tower.", "multi_modal_projector.", "embed_vision.")
# Stored beside the tower but unused by it: SigLIP's pooling head (Gemma 3 reads patches) and
# position-id buffers.
_UNUSED = ("vision_tower.head.", "position_ids")
_CLIP_BOUNDS = ("input_min", "input_max", "output_min", "output_max")
# Gemma 3's (SigLIP's) patch convolution, as the tower names it.
PATCH_EMBED = "vision_tower.embeddings.patch_embedding.weight"


def load_gemma_vision(model_dir: Path | str, dtype: mx.Dtype) -> GemmaVisionTower | None:
    """The dir's Gemma vision tower with float weights in `dtype`; None when the config is
    not a Gemma 3 / Gemma 4 multimodal one (a converted text-only dir included)."""
    raw = read_config_json(Path(model_dir))
    config = read_gemma_vision(raw)
    if config is None:
        return None
    stored: dict[str, mx.array] = {}
    for path in safetensors_files(Path(model_dir)):
        stored.update({n: t for n, t in mx.load(str(path)).items() if tower_name(n)})
    quantization = QuantizationConfig.from_config(raw)
    if quantization is not None:
        stored = dequantize_weights(stored, quantization)
    tower = (Gemma3VisionTower if isinstance(config, Gemma3VisionConfig)
             else Gemma4VisionTower)(config)
    wanted = {name for name, _ in tree_flatten(tower.parameters())}
    weights = {}
    for name, tensor in stored.items():
        target = tower_name(name)
        if target in wanted:
            weights[target] = tensor
        elif not _ignored(target):
            raise ValueError(f"{model_dir}: tensor {name!r} is not part of the "
                             f"{raw['model_type']} vision tower")
    if PATCH_EMBED in weights:
        weights[PATCH_EMBED] = conv_as_torch(weights[PATCH_EMBED])
    tower.load_weights([(n, t.astype(dtype)) for n, t in weights.items()], strict=True)
    tower.eval()
    mx.eval(tower.parameters())
    return tower


def converted_tower_shapes(config: Gemma3VisionConfig | Gemma4VisionConfig,
                           ) -> dict[str, tuple[int, ...]]:
    """The float tower's tensors as a converted dir keeps them (`model.` and the tower's
    names, `weights.TOWER_PREFIXES`), with their shapes."""
    tower = (Gemma3VisionTower if isinstance(config, Gemma3VisionConfig)
             else Gemma4VisionTower)(config)
    return {"model." + name: tuple(p.shape) for name, p in tree_flatten(tower.parameters())}


def converted_tower_name(name: str) -> str | None:
    """A stored tensor's name in a converted dir if it is the tower's (`model.` + its name
    here), else None; the tensors the tower has no use for are the tower's too (dropped by
    the caller's shape check unless wanted)."""
    target = tower_name(name)
    return None if target is None else "model." + target


def tower_name(name: str) -> str | None:
    """The tower's name for a stored tensor; None for the text model's (and audio's)."""
    name = name.removeprefix("model.").replace("vision_tower.vision_model.", "vision_tower.")
    return name if name.startswith(_TOWER_PREFIXES) else None


def _ignored(name: str) -> bool:
    """Tensors a checkpoint may hold that the tower has no use for; clip bounds of a tower
    configured without clipping too, as transformers leaves them then."""
    return any(part in name for part in _UNUSED) or name.endswith(_CLIP_BOUNDS)


def conv_as_torch(weight: mx.array) -> mx.array:
    """Gemma 3's patch convolution as PyTorch's `[out, channels, p, p]`, from either layout
    (mlx-vlm stores it as MLX's `[out, p, p, channels]`)."""
    return weight.transpose(0, 3, 1, 2) if _is_channel_last(tuple(weight.shape)) else weight


def conv_shape_as_torch(shape: tuple[int, ...]) -> tuple[int, ...]:
    return (shape[0], shape[3], shape[1], shape[2]) if _is_channel_last(shape) else shape


def _is_channel_last(shape: tuple[int, ...]) -> bool:
    """A patch is square: PyTorch's last two sides are equal, MLX's are a side and the
    channels."""
    return len(shape) == 4 and shape[2] != shape[3]
