"""The Qwen3-VL / Qwen3.5 vision tower in MLX: patches in, one embedding per merge block of
patches out (the text model's width), plus Qwen3-VL's deepstack features.

    patches [N, C*T*P*P] --patch_embed--> + learned positions (resampled to the grid)
      --blocks (LayerNorm, 2-D rotary attention within each image, MLP)-->
      --merger (LayerNorm, merge x merge neighbours concatenated, MLP)--> embeds [N / merge^2, D]
    after each block in deepstack_layers: its own merger (LayerNorm after concatenating)

Parameter names are Hugging Face's (`model.visual.*` there), except the patch embedding: a
Conv3d whose stride equals its kernel is one product over the flattened patch, so it is a
Linear here and loading flattens the conv weight (metal_engine.vision.qwen_vision_loading).
Products, norms and attention go through the ops backend the text model computes with
(metal_engine.models.ops_user).
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from metal_engine.models.layers import LayerNorm, Linear
from metal_engine.models.ops_user import OpsModel, OpsUser
from metal_engine.vision.features import ProcessedImage, VisionFeatures
from metal_engine.vision.qwen_vision_config import QwenVisionConfig
from metal_engine.vision.qwen_vision_grid import (
    Grid,
    attention_segments,
    position_interpolation,
    rotary_positions,
)

_ACTIVATIONS = {"gelu_pytorch_tanh": nn.gelu_approx, "gelu": nn.gelu, "silu": nn.silu}
_NORM_EPS = 1e-6


class VisionAttention(nn.Module, OpsUser):
    def __init__(self, cfg: QwenVisionConfig) -> None:
        super().__init__()
        self.num_heads, self.scale = cfg.num_heads, cfg.head_dim ** -0.5
        self.qkv = Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.proj = Linear(cfg.hidden_size, cfg.hidden_size)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array,
                 segments: Sequence[tuple[int, int]]) -> mx.array:
        rows = x.shape[0]
        q, k, v = mx.split(self.qkv(x).reshape(rows, 3, self.num_heads, -1), 3, axis=1)
        q, k = (rotate(t.squeeze(1), cos, sin) for t in (q, k))
        v = v.squeeze(1)
        # One attention per image (frame): its n_i rows cost n_i^2 scores per head, where a
        # block-diagonal mask over the batch would cost (sum n_i)^2 and mask most of them.
        outs = [self._attend(q[s:e], k[s:e], v[s:e]) for s, e in segments]
        return self.proj(mx.concatenate(outs).reshape(rows, -1))

    def _attend(self, q: mx.array, k: mx.array, v: mx.array) -> mx.array:
        """Bidirectional attention of one segment's [n, H, D] rows."""
        q, k, v = (t.swapaxes(0, 1)[None] for t in (q, k, v))
        return self.ops.dense_attention(q, k, v, self.scale)[0].swapaxes(0, 1)


def rotate(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """Rotary embedding over the whole head (halves rotated together), in float32 as
    transformers computes it; [rows, heads, head_dim] with cos/sin [rows, 1, head_dim]."""
    xf = x.astype(mx.float32)
    first, second = mx.split(xf, 2, axis=-1)
    return (xf * cos + mx.concatenate([-second, first], axis=-1) * sin).astype(x.dtype)


class VisionMLP(nn.Module):
    def __init__(self, cfg: QwenVisionConfig) -> None:
        super().__init__()
        self.linear_fc1 = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.linear_fc2 = Linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = _ACTIVATIONS[cfg.hidden_act]

    def __call__(self, x: mx.array) -> mx.array:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, cfg: QwenVisionConfig) -> None:
        super().__init__()
        self.norm1 = LayerNorm(cfg.hidden_size, eps=_NORM_EPS)
        self.norm2 = LayerNorm(cfg.hidden_size, eps=_NORM_EPS)
        self.attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array,
                 segments: Sequence[tuple[int, int]]) -> mx.array:
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Each merge block's patches concatenated, through an MLP to the text width. The final
    merger normalizes each patch before; the deepstack ones the concatenation after."""

    def __init__(self, cfg: QwenVisionConfig, norm_after_merge: bool) -> None:
        super().__init__()
        self.width = cfg.hidden_size * cfg.spatial_merge_size ** 2
        self.norm_after_merge = norm_after_merge
        self.norm = LayerNorm(self.width if norm_after_merge else cfg.hidden_size, eps=_NORM_EPS)
        self.linear_fc1 = Linear(self.width, self.width)
        self.linear_fc2 = Linear(self.width, cfg.out_hidden_size)

    def __call__(self, x: mx.array) -> mx.array:
        if self.norm_after_merge:
            x = self.norm(x.reshape(-1, self.width))
        else:
            x = self.norm(x).reshape(-1, self.width)
        return self.linear_fc2(nn.gelu(self.linear_fc1(x)))


class QwenVisionTower(OpsModel):
    """The tower; `__call__` encodes a batch of images given as their concatenated patches."""

    def __init__(self, cfg: QwenVisionConfig) -> None:
        super().__init__()
        self.config = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.blocks = [VisionBlock(cfg) for _ in range(cfg.depth)]
        self.merger = PatchMerger(cfg, norm_after_merge=False)
        self.deepstack_merger_list = [PatchMerger(cfg, norm_after_merge=True)
                                      for _ in cfg.deepstack_layers]
        half = cfg.head_dim // 2  # half the head for rows, half for columns
        self._inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, half, 2, dtype=np.float32) / half))

    def __call__(self, pixel_values: mx.array, grids: Sequence[Grid]) -> VisionFeatures:
        """`pixel_values` [sum of t*h*w, patch_dim]: the images' patches one after another,
        `grids` their (t, h, w)."""
        cfg, grids = self.config, [tuple(int(n) for n in g) for g in grids]
        if pixel_values.shape != (sum(t * h * w for t, h, w in grids), cfg.patch_dim):
            raise ValueError(f"pixel_values of shape {pixel_values.shape} do not hold the "
                             f"patches of grids {grids} ({cfg.patch_dim} values a patch)")
        x = self.patch_embed(pixel_values.astype(self.pos_embed.weight.dtype))
        x = x + self.learned_positions(grids).astype(x.dtype)
        cos, sin = self.rotary(grids)
        segments = attention_segments(grids)
        deepstack = []
        for layer, block in enumerate(self.blocks):
            x = block(x, cos, sin, segments)
            if layer in cfg.deepstack_layers:
                merger = self.deepstack_merger_list[cfg.deepstack_layers.index(layer)]
                deepstack.append(merger(x))
        counts = tuple(t * h * w // cfg.spatial_merge_size ** 2 for t, h, w in grids)
        return VisionFeatures(self.merger(x), tuple(deepstack), counts)

    def encode(self, images: Sequence[ProcessedImage]) -> VisionFeatures:
        """The features of preprocessed images, batched in one pass."""
        pixels = np.concatenate([image.pixel_values for image in images])
        return self(mx.array(pixels), [image.grid for image in images])

    def learned_positions(self, grids: Sequence[Grid]) -> mx.array:
        """The learned position grid resampled to each image's: [num_patches, hidden]."""
        indices, weights = position_interpolation(grids, self.config.grid_side,
                                                  self.config.spatial_merge_size)
        table = self.pos_embed(mx.array(indices))  # [num_patches, 4, hidden]
        return (table * mx.array(weights)[:, :, None].astype(table.dtype)).sum(axis=1)

    def rotary(self, grids: Sequence[Grid]) -> tuple[mx.array, mx.array]:
        """cos and sin [num_patches, 1, head_dim] (float32): a quarter of the head's frequencies
        turn with the patch's row, a quarter with its column, the other half repeats them."""
        positions = rotary_positions(grids, self.config.spatial_merge_size).astype(np.float32)
        angles = (positions[:, :, None] * self._inv_freq).reshape(len(positions), -1)
        angles = mx.array(np.concatenate([angles, angles], axis=-1)[:, None, :])
        return mx.cos(angles), mx.sin(angles)


class PatchEmbed(nn.Module):
    """The Conv3d over each (C, T, P, P) patch, as one product: `proj` holds its weight
    flattened to [hidden, C*T*P*P] in the same order as the processor flattens a patch."""

    def __init__(self, cfg: QwenVisionConfig) -> None:
        super().__init__()
        self.proj = Linear(cfg.patch_dim, cfg.hidden_size)

    def __call__(self, patches: mx.array) -> mx.array:
        return self.proj(patches)
