"""llama.cpp's MXFP4 expert tensors re-laid into MLX's mxfp4 layout, kept quantized.

A ggml MXFP4 block is 17 bytes for 32 values along a row's input: one E8M0 exponent (bias 127,
as MLX's scales), then 16 bytes whose low nibbles hold values 0-15 and high nibbles values
16-31, as FP4 e2m1 codes (llama.cpp doubles its value table and halves the exponent's power,
which cancels). MLX packs the 32 codes in order, two a byte from the low nibble up, so the
nibbles are reordered; the exponents are the scales as they are.
"""

from __future__ import annotations

import numpy as np

from metal_engine.loading.quantization import MXFP4

BLOCK_BYTES = 1 + MXFP4.group_size // 2


def mlx_mxfp4(raw: np.ndarray, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """(weight uint32 `[..., in / 8]`, scales uint8 `[..., in / 32]`) of the ggml MXFP4 bytes
    `raw` holding a float tensor of `shape` (`[experts, out, in]`)."""
    *outer, width = shape
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(*outer, width // 32, BLOCK_BYTES)
    scales, packed = blocks[..., 0], blocks[..., 1:]
    codes = np.concatenate([packed & 0x0F, packed >> 4], axis=-1)  # values 0..31 in order
    pairs = codes[..., 0::2] | (codes[..., 1::2] << 4)
    weight = np.ascontiguousarray(pairs).view("<u4").reshape(*outer, width // 8)
    return weight, np.ascontiguousarray(scales)
