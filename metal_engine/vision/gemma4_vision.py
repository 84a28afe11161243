"""Gemma 4's vision tower, one image at a time (each has its own patch grid):

- patches (pixels mapped to [-1, 1]) projected by a matmul, plus a learned embedding of the
  patch's column and one of its row;
- encoder layers with Gemma's sandwich RMS norms, attention at scale 1 over RMS-normed q, k
  and (unscaled) v, 2-D rope (the first half of each head turned by the column, the second by
  the row), and a gated gelu MLP; linears optionally clamp their inputs and outputs;
- k x k average pooling to soft tokens, scaled by sqrt(hidden) (optionally standardized);
- the embedder: an unscaled RMS norm, then a projection to the text model's width.

Module names follow transformers' Gemma4Model (`vision_tower.*`, `embed_vision.*`). Products,
norms and attention go through the ops backend of the model it serves
(metal_engine.models.ops_user).
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from metal_engine.models.layers import Linear, RMSNorm
from metal_engine.models.ops_user import OpsModel, OpsUser
from metal_engine.vision.features import ProcessedImage, VisionFeatures
from metal_engine.vision.gemma_config import Gemma4VisionConfig
from metal_engine.vision.siglip import ACTIVATION


class ClippableLinear(nn.Module):
    """A linear without bias; with `clipped`, its input and output clamped to loaded bounds."""

    def __init__(self, dims_in: int, dims_out: int, clipped: bool) -> None:
        super().__init__()
        self.linear = Linear(dims_in, dims_out, bias=False)
        self.clipped = clipped
        if clipped:
            self.input_min, self.output_min = mx.array(-mx.inf), mx.array(-mx.inf)
            self.input_max, self.output_max = mx.array(mx.inf), mx.array(mx.inf)

    def __call__(self, x: mx.array) -> mx.array:
        if not self.clipped:
            return self.linear(x)
        y = self.linear(mx.clip(x, self.input_min, self.input_max))
        return mx.clip(y, self.output_min, self.output_max)


def axial_rope(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """Rotate-half rope within each half of the head: `x` `[N, heads, D]`, `cos`/`sin`
    `[N, 1, D]` (columns' angles over the first half, rows' over the second)."""
    quarter = x.shape[-1] // 4
    a, b, c, d = (x[..., i * quarter:(i + 1) * quarter] for i in range(4))
    return x * cos + mx.concatenate([-b, a, -d, c], axis=-1) * sin


def rope_angles(grid: tuple[int, int], head_dim: int, theta: float) -> mx.array:
    """`[rows * cols, head_dim]` angles, patches row-major: each half of the head pairs
    `head_dim / 4` frequencies twice, the first half with the column, the second with the row."""
    rows, cols = grid
    inv_freq = theta ** -(np.arange(0, head_dim // 2, 2, dtype=np.float32) / (head_dim // 2))
    col = np.tile(np.arange(cols, dtype=np.float32), rows)[:, None] * inv_freq
    row = np.repeat(np.arange(rows, dtype=np.float32), cols)[:, None] * inv_freq
    return mx.array(np.concatenate([col, col, row, row], axis=-1))


class VisionAttention(nn.Module, OpsUser):
    def __init__(self, cfg: Gemma4VisionConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim, self.eps = cfg.head_dim, cfg.rms_norm_eps
        hidden, clipped = cfg.hidden_size, cfg.use_clipped_linears
        self.q_proj = ClippableLinear(hidden, self.num_heads * self.head_dim, clipped)
        self.k_proj = ClippableLinear(hidden, self.num_kv_heads * self.head_dim, clipped)
        self.v_proj = ClippableLinear(hidden, self.num_kv_heads * self.head_dim, clipped)
        self.o_proj = ClippableLinear(self.num_heads * self.head_dim, hidden, clipped)
        self.q_norm = RMSNorm(self.head_dim, eps=self.eps)
        self.k_norm = RMSNorm(self.head_dim, eps=self.eps)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
        length = x.shape[0]
        q = self.q_proj(x).reshape(length, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(length, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(length, self.num_kv_heads, self.head_dim)
        q = axial_rope(self.q_norm(q), cos, sin)
        k = axial_rope(self.k_norm(k), cos, sin)
        v = self.ops.rms_norm(v, None, self.eps)
        out = self.ops.dense_attention(*(t.transpose(1, 0, 2)[None] for t in (q, k, v)), 1.0)
        return self.o_proj(out[0].transpose(1, 0, 2).reshape(length, -1))


class VisionMLP(nn.Module):
    def __init__(self, cfg: Gemma4VisionConfig) -> None:
        super().__init__()
        hidden, inner, clipped = cfg.hidden_size, cfg.intermediate_size, cfg.use_clipped_linears
        self.act = ACTIVATION[cfg.hidden_activation]
        self.gate_proj = ClippableLinear(hidden, inner, clipped)
        self.up_proj = ClippableLinear(hidden, inner, clipped)
        self.down_proj = ClippableLinear(inner, hidden, clipped)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class VisionEncoderLayer(nn.Module):
    def __init__(self, cfg: Gemma4VisionConfig) -> None:
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg)
        self.input_layernorm = RMSNorm(hidden, eps=eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps=eps)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps=eps)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps=eps)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class VisionEncoder(nn.Module):
    def __init__(self, cfg: Gemma4VisionConfig) -> None:
        super().__init__()
        self.layers = [VisionEncoderLayer(cfg) for _ in range(cfg.num_hidden_layers)]

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
        for layer in self.layers:
            x = layer(x, cos, sin)
        return x


class PatchEmbedder(nn.Module):
    def __init__(self, cfg: Gemma4VisionConfig) -> None:
        super().__init__()
        self.input_proj = Linear(3 * cfg.patch_size**2, cfg.hidden_size, bias=False)
        self.position_embedding_table = mx.zeros((2, cfg.position_embedding_size,
                                                  cfg.hidden_size))

    def __call__(self, patches: mx.array, grid: tuple[int, int]) -> mx.array:
        rows, cols = grid
        table = self.position_embedding_table
        by_col = mx.tile(table[0, :cols], (rows, 1))
        by_row = mx.repeat(table[1, :rows], cols, axis=0)
        return self.input_proj(2 * (patches - 0.5)) + by_col + by_row


class Gemma4VisionModel(nn.Module):
    def __init__(self, cfg: Gemma4VisionConfig) -> None:
        super().__init__()
        self.config = cfg
        self.patch_embedder = PatchEmbedder(cfg)
        self.encoder = VisionEncoder(cfg)
        if cfg.standardize:
            self.std_bias = mx.zeros((cfg.hidden_size,))
            self.std_scale = mx.ones((cfg.hidden_size,))

    def __call__(self, patches: mx.array, grid: tuple[int, int]) -> mx.array:
        """One image's `[rows * cols, 3 * p * p]` patches -> `[rows * cols / k^2, hidden]`."""
        cfg = self.config
        angles = rope_angles(grid, cfg.head_dim, cfg.rope_theta)[:, None]
        cos, sin = mx.cos(angles).astype(patches.dtype), mx.sin(angles).astype(patches.dtype)
        hidden = self.encoder(self.patch_embedder(patches, grid), cos, sin)
        # Pooled and scaled in float32: sqrt(hidden) can carry the values past float16's range.
        pooled = pool(hidden.astype(mx.float32), grid, cfg.pooling_kernel_size)
        pooled = pooled * cfg.hidden_size**0.5
        if cfg.standardize:
            pooled = (pooled - self.std_bias.astype(mx.float32)) * self.std_scale.astype(mx.float32)
        return pooled.astype(patches.dtype)


def pool(hidden: mx.array, grid: tuple[int, int], k: int) -> mx.array:
    """Mean over each k x k block of the patch grid, blocks row-major."""
    rows, cols = grid
    blocks = hidden.reshape(rows // k, k, cols // k, k, hidden.shape[-1])
    return blocks.mean(axis=(1, 3)).reshape(-1, hidden.shape[-1])


class MultimodalEmbedder(nn.Module, OpsUser):
    def __init__(self, cfg: Gemma4VisionConfig) -> None:
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.embedding_projection = Linear(cfg.hidden_size, cfg.text_hidden_size, bias=False)

    def __call__(self, soft_tokens: mx.array) -> mx.array:
        normed = self.ops.rms_norm(soft_tokens.astype(mx.float32), None, self.eps)
        return self.embedding_projection(normed.astype(soft_tokens.dtype))


class Gemma4VisionTower(OpsModel):
    """Images of any size -> soft tokens for the text model."""

    def __init__(self, cfg: Gemma4VisionConfig) -> None:
        super().__init__()
        self.config = cfg
        self.vision_tower = Gemma4VisionModel(cfg)
        self.embed_vision = MultimodalEmbedder(cfg)

    def __call__(self, patches: mx.array, grid: tuple[int, int]) -> mx.array:
        """One image's patches -> `[num_tokens, text_hidden]`."""
        return self.embed_vision(self.vision_tower(patches, grid))

    def encode(self, images: Sequence[ProcessedImage]) -> VisionFeatures:
        """Each image on its own (grids differ); their rows one after another."""
        dtype = self.embed_vision.embedding_projection.weight.dtype
        embeds = [self(mx.array(image.pixel_values).astype(dtype), image.grid)
                  for image in images]
        return VisionFeatures(mx.concatenate(embeds, axis=0), (),
                              tuple(image.num_tokens for image in images))
