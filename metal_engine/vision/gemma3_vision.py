"""Gemma 3's vision tower: the SigLIP encoder, then the multimodal projector, which
average-pools the patch grid to `mm_tokens_per_image` soft tokens, RMS-normalizes them
(`1 + w` scale) and projects them to the text model's width.

Module names follow transformers' Gemma3Model (`vision_tower.*`, `multi_modal_projector.*`).
What the text model does with the output: metal_engine.vision.gemma_text_side.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from metal_engine.models.ops_user import OpsModel, OpsUser
from metal_engine.vision.features import ProcessedImage, VisionFeatures
from metal_engine.vision.gemma_config import Gemma3VisionConfig
from metal_engine.vision.siglip import SiglipVisionModel


class OffsetRMSNorm(nn.Module, OpsUser):
    """Gemma's RMSNorm: scale `1 + w`, computed in float32 as transformers' tower does."""

    def __init__(self, dims: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = mx.zeros((dims,))

    def __call__(self, x: mx.array) -> mx.array:
        scale = 1.0 + self.weight.astype(mx.float32)
        return self.ops.rms_norm(x.astype(mx.float32), scale, self.eps).astype(x.dtype)


class Gemma3MultiModalProjector(nn.Module):
    def __init__(self, cfg: Gemma3VisionConfig) -> None:
        super().__init__()
        vision = cfg.vision
        self.side = vision.patches_per_side
        self.kernel = vision.patches_per_side // cfg.tokens_per_side
        self.mm_input_projection_weight = mx.zeros((vision.hidden_size, cfg.text_hidden_size))
        self.mm_soft_emb_norm = OffsetRMSNorm(vision.hidden_size, vision.layer_norm_eps)

    def __call__(self, patches: mx.array) -> mx.array:
        """`[B, side * side, hidden]` -> `[B, tokens, text_hidden]`."""
        batch, _, hidden = patches.shape
        tokens, k = self.side // self.kernel, self.kernel
        grid = patches.reshape(batch, tokens, k, tokens, k, hidden)
        pooled = grid.mean(axis=(2, 4)).reshape(batch, tokens * tokens, hidden)
        return self.mm_soft_emb_norm(pooled) @ self.mm_input_projection_weight


class Gemma3VisionTower(OpsModel):
    """Images of the encoder's one size -> soft tokens for the text model."""

    def __init__(self, cfg: Gemma3VisionConfig) -> None:
        super().__init__()
        self.config = cfg
        self.vision_tower = SiglipVisionModel(cfg.vision)
        self.multi_modal_projector = Gemma3MultiModalProjector(cfg)

    def __call__(self, pixels: mx.array) -> mx.array:
        """`[B, 3, H, W]` -> `[B, mm_tokens_per_image, text_hidden]`."""
        return self.multi_modal_projector(self.vision_tower(pixels))

    def encode(self, images: Sequence[ProcessedImage]) -> VisionFeatures:
        """All images in one batch; their rows one after another."""
        dtype = self.multi_modal_projector.mm_input_projection_weight.dtype
        pixels = mx.array(np.stack([image.pixel_values for image in images])).astype(dtype)
        embeds = self(pixels)
        return VisionFeatures(embeds.reshape(-1, embeds.shape[-1]), (),
                              tuple(image.num_tokens for image in images))
