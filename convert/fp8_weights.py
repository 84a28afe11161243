"""Block-quantized FP8 checkpoints (DeepSeek V3 / R1 and Kimi K2 as published), dequantized at
conversion.

Such a checkpoint's config.json says `quantization_config: {"quant_method": "fp8",
"weight_block_size": [128, 128], ...}`; each quantized linear then stores `weight` as float8
e4m3 `[out, in]` and `weight_scale_inv`, float32 `[ceil(out / 128), ceil(in / 128)]`: an
element's value is its e4m3 value times its block's scale. The rest (norms, the router, its
correction bias, embeddings) is stored as it is. The conversion writes every quantized linear
as that product, in float32 (exact: an e4m3 value has 4 significant bits), then the output
dtype or `--quantize`'s MLX format as for any float source.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

QUANT_METHOD = "fp8"
SCALE_SUFFIX = ".weight_scale_inv"


def fp8_block(config: dict[str, Any]) -> tuple[int, int] | None:
    """The (rows, columns) of a scale block if config.json describes a block-quantized FP8
    checkpoint, else None; other FP8 layouts are refused by name."""
    entries = config.get("quantization_config") or {}
    if entries.get("quant_method") != QUANT_METHOD:
        return None
    block = entries.get("weight_block_size")
    if entries.get("fmt", "e4m3") != "e4m3" or not (isinstance(block, list) and len(block) == 2):
        raise ValueError(f"this FP8 checkpoint stores {entries.get('fmt', 'e4m3')} with block "
                         f"{block!r}; metal-serve reads e4m3 weights with [rows, columns] "
                         "blocks of scales (DeepSeek's layout)")
    return int(block[0]), int(block[1])


def dequantize_fp8(weight: mx.array, scale_inv: mx.array, block: tuple[int, int]) -> mx.array:
    """`weight` (float8 e4m3 codes, as mx.load reads them: uint8) times its blocks' scales,
    in float32."""
    rows, columns = weight.shape
    values = mx.from_fp8(weight, dtype=mx.float32)
    scales = mx.repeat(mx.repeat(scale_inv.astype(mx.float32), block[0], axis=0),
                       block[1], axis=1)
    return values * scales[:rows, :columns]
