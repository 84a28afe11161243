"""GPT-OSS's experts as OpenAI publishes them, in MXFP4: kept so, re-laid into MLX's mxfp4
layout (see metal_engine.loading.quantization), the rest of the checkpoint being float.

The Hugging Face checkpoint stores each layer's fused experts as

    experts.gate_up_proj_blocks  uint8 [experts, 2 * inner, hidden / 32, 16]
    experts.gate_up_proj_scales  uint8 [experts, 2 * inner, hidden / 32]

and `down_proj_*` likewise (`[experts, hidden, inner / 32, ...]`): rows are outputs, each
row's inputs in blocks of 32 FP4 (e2m1) codes two a byte, the even element in the low nibble,
with one E8M0 exponent (bias 127) per block. That is the `[out, in]` order MLX quantizes in,
and MLX packs eight codes a uint32 from the low bits up, so on a little-endian host the
blocks' bytes are its words as they are. Gate and up rows alternate (even, odd), as in the
float layout; biases stay float and are split as there (convert.expert_stacking).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import mlx.core as mx

from metal_engine.loading.quantization import MXFP4, QuantParams

QUANT_METHOD = "mxfp4"
FAMILIES = ("gpt_oss",)
BLOCK_BYTES = MXFP4.group_size * MXFP4.bits // 8
_PACKED = re.compile(r"(.+)\.experts\.(gate_up_proj|down_proj)_(blocks|scales)")
_GATE_UP = ("gate_proj", "up_proj")


def is_mxfp4_checkpoint(config: dict[str, Any]) -> bool:
    """Whether config.json describes a Hugging Face MXFP4 checkpoint; one of a family other
    than GPT-OSS's is refused."""
    method = (config.get("quantization_config") or {}).get("quant_method")
    if method != QUANT_METHOD:
        return False
    if config.get("model_type") not in FAMILIES:
        raise ValueError(f"this {config.get('model_type')!r} checkpoint is quantized with "
                         "mxfp4, which metal-serve converts only for GPT-OSS; use its float "
                         "checkpoint")
    return True


def relaid_shapes(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """`shapes` with every packed expert tensor replaced by the MLX tensors it becomes."""
    return {new: shape for name, old in shapes.items()
            for new, shape in (_relaid_shapes(name, old) or [(name, old)])}


def relay_tensors(tensors: Iterator[tuple[str, mx.array]]) -> Iterator[tuple[str, mx.array]]:
    """The tensor stream with every packed expert tensor re-laid; the rest passes through."""
    for name, tensor in tensors:
        yield from (_relay(name, tensor) if _PACKED.fullmatch(name) else [(name, tensor)])


def packed_modules(names: list[str]) -> dict[str, QuantParams]:
    """The expert projections (module paths) whose blocks are among the source `names`."""
    modules: dict[str, QuantParams] = {}
    for name in names:
        match = _PACKED.fullmatch(name)
        if match is not None and match[3] == "blocks":
            projections = ("down_proj",) if match[2] == "down_proj" else _GATE_UP
            modules.update({f"{match[1]}.experts.{p}": MXFP4 for p in projections})
    return modules


def _relaid_shapes(name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]] | None:
    match = _PACKED.fullmatch(name)
    if match is None:
        return None
    block, fused, kind = match.groups()
    if kind == "blocks":
        if len(shape) != 4 or shape[-1] != BLOCK_BYTES:
            raise ValueError(f"{name} has shape {shape}; MXFP4 blocks are [experts, rows, "
                             f"blocks, {BLOCK_BYTES}]")
        experts, rows, groups, _ = shape
        shape = (experts, rows, groups * BLOCK_BYTES // 4)  # as uint32 words
    suffix = "weight" if kind == "blocks" else "scales"
    if fused == "down_proj":
        return [(f"{block}.experts.down_proj.{suffix}", shape)]
    experts, rows, width = shape
    return [(f"{block}.experts.{p}.{suffix}", (experts, rows // 2, width)) for p in _GATE_UP]


def _relay(name: str, tensor: mx.array) -> list[tuple[str, mx.array]]:
    names = [n for n, _ in _relaid_shapes(name, tuple(tensor.shape))]
    if tensor.dtype != mx.uint8:
        raise ValueError(f"{name} is {tensor.dtype}; MXFP4 blocks and scales are uint8")
    if name.endswith("_blocks"):
        tensor = tensor.view(mx.uint32).flatten(-2)
    if len(names) == 1:
        return [(names[0], tensor)]
    return list(zip(names, (tensor[:, 0::2], tensor[:, 1::2]), strict=True))
