"""The vision tower of Qwen3-VL (`qwen3_vl`, `qwen3_vl_moe`) and Qwen3.5 / 3.6 (`qwen3_5`,
`qwen3_5_moe`) as config.json describes it, and the token ids that mark images in a prompt.

Keys a config leaves out take transformers' defaults for the family; Qwen3-VL's tower also
hands features of some middle layers to the text model ("deepstack"), Qwen3.5's does not.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass
from typing import Any

# The multimodal families with this tower -> whether they carry deepstack features.
DEEPSTACK = {"qwen3_vl": True, "qwen3_vl_moe": True, "qwen3_5": False, "qwen3_5_moe": False}
QWEN_VISION_FAMILIES = tuple(DEEPSTACK)
ACTIVATIONS = ("gelu_pytorch_tanh", "gelu", "silu")
# transformers' Qwen3VLVisionConfig / Qwen3_5VisionConfig defaults.
_DEFAULTS: dict[str, Any] = {
    "depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16,
    "in_channels": 3, "patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2,
    "out_hidden_size": 3584, "num_position_embeddings": 2304, "hidden_act": "gelu_pytorch_tanh",
}
_DEEPSTACK_DEFAULT = (8, 16, 24)
_ROPE_THETA = 10000.0
# The token ids of the Qwen3-VL and Qwen3.5 vocabularies, where config.json leaves them out.
_TOKEN_DEFAULTS = {
    "qwen3_vl": (151655, 151656, 151652, 151653),
    "qwen3_5": (248056, 248057, 248053, 248054),
}
_TOKEN_KEYS = ("image_token_id", "video_token_id", "vision_start_token_id",
               "vision_end_token_id")


@dataclass(frozen=True)
class QwenVisionConfig:
    """The tower's shape. `deepstack_layers`: the blocks after which a feature map is merged
    for the text model (empty for Qwen3.5)."""

    family: str
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    num_position_embeddings: int
    hidden_act: str
    deepstack_layers: tuple[int, ...]
    rope_theta: float = _ROPE_THETA

    def __post_init__(self) -> None:
        if self.family not in DEEPSTACK:
            raise ValueError(f"vision family {self.family!r} is not one of "
                             f"{', '.join(QWEN_VISION_FAMILIES)}")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"vision hidden_act {self.hidden_act!r} is not supported; "
                             f"choose one of {', '.join(ACTIVATIONS)}")
        if self.hidden_size % self.num_heads or self.head_dim % 4:
            raise ValueError(f"vision hidden_size {self.hidden_size} over {self.num_heads} "
                             "heads must give a head_dim divisible by 4 (2-D rotary)")
        side = round(self.num_position_embeddings ** 0.5)
        if side * side != self.num_position_embeddings:
            raise ValueError(f"num_position_embeddings {self.num_position_embeddings} is not a "
                             "square: the learned positions form a square grid")
        bad = [i for i in self.deepstack_layers if not 0 <= i < self.depth]
        if bad:
            raise ValueError(f"deepstack_visual_indexes {bad} fall outside the {self.depth} "
                             "vision blocks")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def grid_side(self) -> int:
        """Side of the square grid of learned position embeddings."""
        return round(self.num_position_embeddings ** 0.5)

    @property
    def patch_dim(self) -> int:
        """Values in one flattened patch: channels x temporal x patch x patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2


@dataclass(frozen=True)
class ImageTokenIds:
    """Prompt tokens around and in place of an image: `<vision_start> <image>*n <vision_end>`."""

    image: int
    video: int
    vision_start: int
    vision_end: int


def vision_family(config: dict[str, Any]) -> str | None:
    """The Qwen vision family of a config.json, None for a config without that tower. A
    multimodal checkpoint names it at the top level; a converted dir (a text config) in its
    `vision_config`'s model_type (transformers writes `qwen3_vl_vision` there, the hub
    checkpoints `qwen3_vl`)."""
    if not isinstance(config.get("vision_config"), dict):
        return None
    if config.get("model_type") in DEEPSTACK:
        return config["model_type"]
    nested = str(config["vision_config"].get("model_type", "")).removesuffix("_vision")
    return nested if nested in DEEPSTACK else None


def read_vision_config(config: dict[str, Any]) -> QwenVisionConfig | None:
    """The tower described by a config.json (multimodal or converted), None without one."""
    family = vision_family(config)
    if family is None:
        return None
    raw = config["vision_config"]
    values = {key: raw.get(key, default) for key, default in _DEFAULTS.items()}
    deepstack = raw.get("deepstack_visual_indexes", _DEEPSTACK_DEFAULT) if DEEPSTACK[family] else ()
    rope = raw.get("rope_parameters") or {}
    return QwenVisionConfig(family=family, **values, deepstack_layers=tuple(deepstack),
                            rope_theta=float(rope.get("rope_theta", _ROPE_THETA)))


def read_image_token_ids(config: dict[str, Any]) -> ImageTokenIds | None:
    """The image token ids of a config.json with a Qwen tower (top-level keys, else the
    family's vocabulary's), None without one."""
    family = vision_family(config)
    if family is None:
        return None
    defaults = _TOKEN_DEFAULTS[family.removesuffix("_moe")]
    return ImageTokenIds(*(int(config.get(key, default))
                           for key, default in zip(_TOKEN_KEYS, defaults, strict=True)))


def tower_config_entries(config: dict[str, Any]) -> dict[str, Any]:
    """The config.json keys a converted (text) model dir keeps to describe the source's tower:
    its `vision_config`, named by family, and the image token ids."""
    family = vision_family(config)
    if family is None:
        return {}
    tokens = astuple(read_image_token_ids(config))
    return {"vision_config": {**config["vision_config"], "model_type": family},
            **dict(zip(_TOKEN_KEYS, tokens, strict=True))}
