"""Gemma 3's and Gemma 4's vision settings and image token ids, read from a multimodal
config.json (`model_type` gemma3 / gemma4, with a `vision_config`) or a converted dir's (its
text model's `model_type` beside the kept `vision_config` and token ids, `tower_config_entries`),
with transformers' defaults for the keys it leaves out."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal

# The activations the towers' MLPs use, by their transformers names.
ACTIVATIONS = ("gelu_pytorch_tanh", "gelu")
# What transformers assumes when a config.json leaves these out.
_GEMMA3_DEFAULTS = {"image_token_index": 262_144, "boi_token_index": 255_999,
                    "eoi_token_index": 256_000, "mm_tokens_per_image": 256}
_GEMMA4_DEFAULTS = {"image_token_id": 258_880, "boi_token_id": 255_999,
                    "eoi_token_id": 258_882}
_TEXT_HIDDEN_DEFAULTS = {"gemma3": 2304, "gemma4": 2304}
_FAMILIES: dict[Any, Literal["gemma3", "gemma4"]] = {
    "gemma3": "gemma3", "gemma3_text": "gemma3", "gemma4": "gemma4", "gemma4_text": "gemma4"}
_GEMMA4_ROPE_THETA = 100.0


@dataclass(frozen=True)
class ImageTokens:
    """An image enters the prompt as `boi, image x num_tokens, eoi`: the tower's rows replace
    the `image` placeholders; boi and eoi stay text tokens."""

    image_token_id: int
    boi_token_id: int
    eoi_token_id: int

    def around(self, num_tokens: int) -> list[int]:
        return [self.boi_token_id, *[self.image_token_id] * num_tokens, self.eoi_token_id]


@dataclass(frozen=True)
class SiglipConfig:
    """Gemma 3's vision encoder (a SigLIP vision model, without its pooling head)."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 16
    hidden_act: str = "gelu_pytorch_tanh"
    layer_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        _check_activation(self.hidden_act)
        if self.image_size % self.patch_size or self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"vision_config: image_size {self.image_size} must be a multiple of patch_size "
                f"{self.patch_size}, and hidden_size {self.hidden_size} of num_attention_heads "
                f"{self.num_attention_heads}")

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size


@dataclass(frozen=True)
class Gemma3VisionConfig:
    """The SigLIP encoder, and the projector that average-pools its patch grid down to
    `mm_tokens_per_image` soft tokens (a square grid) of the text model's width."""

    vision: SiglipConfig
    text_hidden_size: int
    tokens: ImageTokens
    mm_tokens_per_image: int = 256

    def __post_init__(self) -> None:
        side = self.tokens_per_side
        if side * side != self.mm_tokens_per_image or self.vision.patches_per_side % side:
            raise ValueError(
                f"mm_tokens_per_image {self.mm_tokens_per_image} must be a square whose side "
                f"divides the {self.vision.patches_per_side} patches per side of the image")

    @property
    def tokens_per_side(self) -> int:
        return round(self.mm_tokens_per_image**0.5)


@dataclass(frozen=True)
class Gemma4VisionConfig:
    """Gemma 4's vision encoder (2-D rope, learned x/y position tables, images of any aspect
    ratio), its k x k average pooling to soft tokens, and the embedder into the text model."""

    text_hidden_size: int
    tokens: ImageTokens
    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 16
    num_attention_heads: int = 12
    num_key_value_heads: int = 12
    head_dim: int = 64
    hidden_activation: str = "gelu_pytorch_tanh"
    rms_norm_eps: float = 1e-6
    rope_theta: float = _GEMMA4_ROPE_THETA
    pooling_kernel_size: int = 3
    patch_size: int = 16
    position_embedding_size: int = 10 * 1024
    use_clipped_linears: bool = False
    standardize: bool = False

    def __post_init__(self) -> None:
        _check_activation(self.hidden_activation)
        if self.head_dim % 4 or self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"vision_config: head_dim {self.head_dim} must be a multiple of 4 (two axes of "
                f"rotary pairs), and num_attention_heads {self.num_attention_heads} of "
                f"num_key_value_heads {self.num_key_value_heads}")


def gemma_family(cfg: dict[str, Any]) -> Literal["gemma3", "gemma4"] | None:
    """The Gemma vision family of a config.json with a `vision_config` (multimodal or
    converted); None for any other config (a text-only Gemma included)."""
    if not isinstance(cfg.get("vision_config"), dict):
        return None
    return _FAMILIES.get(cfg.get("model_type"))


def read_gemma_vision(cfg: dict[str, Any]) -> Gemma3VisionConfig | Gemma4VisionConfig | None:
    """The vision settings of a Gemma 3 / Gemma 4 config.json (multimodal or converted); None
    for any other config."""
    family = gemma_family(cfg)
    if family is None:
        return None
    vision = cfg["vision_config"]
    text_hidden = (cfg.get("text_config") or cfg).get("hidden_size",
                                                      _TEXT_HIDDEN_DEFAULTS[family])
    if family == "gemma3":
        return _read_gemma3(cfg, vision, text_hidden)
    return _read_gemma4(cfg, vision, text_hidden)


def tower_config_entries(cfg: dict[str, Any]) -> dict[str, Any]:
    """The config.json keys a converted (text) model dir keeps to describe a Gemma source's
    tower: its `vision_config` and image token ids (Gemma 3's soft tokens per image too)."""
    config = read_gemma_vision(cfg)
    if config is None:
        return {}
    tokens = config.tokens
    if isinstance(config, Gemma3VisionConfig):
        return {"vision_config": cfg["vision_config"], "image_token_index": tokens.image_token_id,
                "boi_token_index": tokens.boi_token_id, "eoi_token_index": tokens.eoi_token_id,
                "mm_tokens_per_image": config.mm_tokens_per_image}
    return {"vision_config": cfg["vision_config"], "image_token_id": tokens.image_token_id,
            "boi_token_id": tokens.boi_token_id, "eoi_token_id": tokens.eoi_token_id}


def _read_gemma3(cfg: dict[str, Any], vision: dict[str, Any],
                 text_hidden: int) -> Gemma3VisionConfig:
    settings = {**_GEMMA3_DEFAULTS, **cfg}
    # transformers reads `image_token_id` as an alias of `image_token_index` (boi/eoi alike).
    for short, long in (("image_token_id", "image_token_index"),
                        ("boi_token_id", "boi_token_index"), ("eoi_token_id", "eoi_token_index")):
        settings[long] = cfg.get(long, cfg.get(short, settings[long]))
    tokens = ImageTokens(settings["image_token_index"], settings["boi_token_index"],
                         settings["eoi_token_index"])
    return Gemma3VisionConfig(_known(SiglipConfig, vision), text_hidden, tokens,
                              settings["mm_tokens_per_image"])


def _read_gemma4(cfg: dict[str, Any], vision: dict[str, Any],
                 text_hidden: int) -> Gemma4VisionConfig:
    settings = {**_GEMMA4_DEFAULTS, **cfg}
    tokens = ImageTokens(settings["image_token_id"], settings["boi_token_id"],
                         settings["eoi_token_id"])
    rope = vision.get("rope_parameters") or {}
    theta = rope.get("rope_theta", vision.get("rope_theta", _GEMMA4_ROPE_THETA))
    return _known(Gemma4VisionConfig, {**vision, "rope_theta": theta},
                  text_hidden_size=text_hidden, tokens=tokens)


def _known(cls, values: dict[str, Any], **extra: Any):
    """`cls` from the keys of `values` it has (config.json carries many it has no use for)."""
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in values.items() if k in names}, **extra)


def _check_activation(name: str) -> None:
    if name not in ACTIVATIONS:
        raise ValueError(f"vision_config: activation {name!r} is not one of {ACTIVATIONS}")
