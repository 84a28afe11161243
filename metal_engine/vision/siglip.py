"""SigLIP's vision encoder (Gemma 3's), without its pooling head: non-overlapping patches
projected by one matmul, a learned position per patch, pre-norm encoder layers (LayerNorm,
bidirectional attention, a gelu MLP), and a final LayerNorm.

Module and parameter names follow transformers' SiglipVisionModel, so a checkpoint's tensors
load by name; the patch projection keeps the convolution's `[out, channels, p, p]` weight.
The encoder carries the batch's patches as rows `[B * patches, hidden]`; products, norms and
attention go through the ops backend of the model it serves (metal_engine.models.ops_user).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from metal_engine.models.layers import LayerNorm, Linear, PackedLinears
from metal_engine.models.ops_user import OpsUser
from metal_engine.vision.gemma_config import SiglipConfig

ACTIVATION = {"gelu_pytorch_tanh": nn.gelu_approx, "gelu": nn.gelu}


class PatchEmbedding(nn.Module):
    """A convolution with stride = kernel = patch, as a matmul over flattened patches."""

    def __init__(self, channels: int, hidden: int, patch: int) -> None:
        super().__init__()
        self.patch = patch
        self.weight = mx.zeros((hidden, channels, patch, patch))
        self.bias = mx.zeros((hidden,))

    def __call__(self, pixels: mx.array) -> mx.array:
        """`[B, C, H, W]` -> `[B, (H/p) * (W/p), hidden]`, patches row-major."""
        batch, channels, height, width = pixels.shape
        p = self.patch
        grid = pixels.reshape(batch, channels, height // p, p, width // p, p)
        flat = grid.transpose(0, 2, 4, 1, 3, 5).reshape(batch, -1, channels * p * p)
        return flat @ self.weight.reshape(self.weight.shape[0], -1).T + self.bias


class Embeddings(nn.Module):
    def __init__(self, cfg: SiglipConfig) -> None:
        super().__init__()
        self.patch_embedding = PatchEmbedding(cfg.num_channels, cfg.hidden_size, cfg.patch_size)
        self.position_embedding = nn.Embedding(cfg.patches_per_side**2, cfg.hidden_size)

    def __call__(self, pixels: mx.array) -> mx.array:
        patches = self.patch_embedding(pixels)
        if patches.shape[1] != self.position_embedding.weight.shape[0]:
            raise ValueError(f"{pixels.shape[-2]}x{pixels.shape[-1]} pixels make "
                             f"{patches.shape[1]} patches; the encoder has positions for "
                             f"{self.position_embedding.weight.shape[0]}")
        return patches + self.position_embedding.weight


class SelfAttention(nn.Module, OpsUser):
    def __init__(self, cfg: SiglipConfig) -> None:
        super().__init__()
        hidden = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.scale = (hidden // self.num_heads) ** -0.5
        self.q_proj = Linear(hidden, hidden)
        self.k_proj = Linear(hidden, hidden)
        self.v_proj = Linear(hidden, hidden)
        self.out_proj = Linear(hidden, hidden)
        self._qkv = PackedLinears(self, "q_proj", "k_proj", "v_proj")

    def __call__(self, x: mx.array, batch: int) -> mx.array:
        """`x [batch * length, hidden]`: each image's rows over its own."""
        rows, hidden = x.shape

        def heads(y: mx.array) -> mx.array:
            return y.reshape(batch, rows // batch, self.num_heads, -1).transpose(0, 2, 1, 3)

        q, k, v = (heads(y) for y in self.ops.linears(x, self._qkv))
        out = self.ops.dense_attention(q, k, v, self.scale)
        return self.out_proj(out.transpose(0, 2, 1, 3).reshape(rows, hidden))


class FeedForward(nn.Module):
    def __init__(self, cfg: SiglipConfig) -> None:
        super().__init__()
        self.act = ACTIVATION[cfg.hidden_act]
        self.fc1 = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = Linear(cfg.intermediate_size, cfg.hidden_size)

    def __call__(self, x: mx.array) -> mx.array:
        return self.fc2(self.act(self.fc1(x)))


class EncoderLayer(nn.Module):
    def __init__(self, cfg: SiglipConfig) -> None:
        super().__init__()
        self.layer_norm1 = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.self_attn = SelfAttention(cfg)
        self.layer_norm2 = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = FeedForward(cfg)

    def __call__(self, x: mx.array, batch: int) -> mx.array:
        x = x + self.self_attn(self.layer_norm1(x), batch)
        return x + self.mlp(self.layer_norm2(x))


class Encoder(nn.Module):
    def __init__(self, cfg: SiglipConfig) -> None:
        super().__init__()
        self.layers = [EncoderLayer(cfg) for _ in range(cfg.num_hidden_layers)]

    def __call__(self, x: mx.array, batch: int) -> mx.array:
        for layer in self.layers:
            x = layer(x, batch)
        return x


class SiglipVisionModel(nn.Module):
    def __init__(self, cfg: SiglipConfig) -> None:
        super().__init__()
        self.embeddings = Embeddings(cfg)
        self.encoder = Encoder(cfg)
        self.post_layernorm = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def __call__(self, pixels: mx.array) -> mx.array:
        """`[B, C, H, W]` -> `[B, patches, hidden]`."""
        patches = self.embeddings(pixels)
        batch, length, hidden = patches.shape
        rows = self.encoder(patches.reshape(batch * length, hidden), batch)
        return self.post_layernorm(rows).reshape(batch, length, hidden)
