"""Quantized K/V pools (`--kv-cache-dtype int8|int4`): the layout and its reference math.

Each token's K (or V) row of each KV head is quantized on its own, in groups of `group`
consecutive features with one float16 scale per group, symmetric (no zero point):

    scale = max|x| / Q (Q = 127 for int8, 7 for int4), rounded to float16
    code  = clip(round(x / scale), -Q, Q)          x ~ code * scale

A row is written once and never requantized as its block fills, so writes stay a scatter
like the float pools'. Symmetric codes with one float16 scale per group are what the issue's
capacity needs: per element int8 takes 1 + 2/64 bytes (1.94x the blocks of float16 at head
dim 64), int4 0.5 + 2/32 (3.56x); an affine zero point would add 2 bytes a group (1.88x and
3.2x). Codes: int8 `[blocks, block_size, kv_heads, D]` as int8; int4 two per byte, feature
2i in the low nibble, 2i + 1 in the high one, each stored as code + 8.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import mlx.core as mx
import numpy as np

SCALE_DTYPE = mx.float16
KV_CACHE_DTYPES = ("auto", "int8", "int4")
# Features per scale, the largest of these that divides the head dim.
GROUP_SIZES = {8: (64, 32, 16, 8), 4: (32, 16, 8)}


@dataclass(frozen=True)
class KVQuant:
    bits: int  # 8 or 4

    @property
    def max_code(self) -> int:
        return 2 ** (self.bits - 1) - 1

    def group(self, head_dim: int) -> int:
        for size in GROUP_SIZES[self.bits]:
            if head_dim % size == 0:
                return size
        raise ValueError(f"head dim {head_dim} cannot be quantized to int{self.bits} "
                         "(it must be a multiple of 8); use --kv-cache-dtype auto")

    def code_width(self, head_dim: int) -> int:
        """Bytes of codes per row of `head_dim` features."""
        return head_dim * self.bits // 8

    def bytes_per_row(self, head_dim: int) -> int:
        """Bytes one token's row of one KV head takes: codes and scales."""
        return self.code_width(head_dim) + head_dim // self.group(head_dim) * SCALE_DTYPE.size


def kv_quant_of(kv_cache_dtype: str) -> KVQuant | None:
    """The quantization `--kv-cache-dtype` names; None for "auto" (the model's dtype)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype {kv_cache_dtype!r} is not supported; use one of "
                         f"{', '.join(KV_CACHE_DTYPES)}")
    return None if kv_cache_dtype == "auto" else KVQuant(int(kv_cache_dtype.removeprefix("int")))


class QuantizedPool(NamedTuple):
    """One quantized K or V pool: what the layers take, write and read in place of an array."""

    codes: mx.array  # [blocks, block_size, kv_heads, D * bits / 8] int8 or uint8
    scales: mx.array  # [blocks, block_size, kv_heads, D / group] float16
    bits: int

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The logical shape `[blocks, block_size, kv_heads, head_dim]` of the float pool."""
        blocks, block_size, kv_heads, width = self.codes.shape
        return blocks, block_size, kv_heads, width * 8 // self.bits

    @property
    def quant(self) -> KVQuant:
        return KVQuant(self.bits)

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes

    def arrays(self) -> list[mx.array]:
        return [self.codes, self.scales]


def empty_pool(num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
               quant: KVQuant) -> QuantizedPool:
    """A pool of zero codes and scales (dequantizes to zeros)."""
    rows = (num_blocks, block_size, kv_heads)
    code_dtype = mx.int8 if quant.bits == 8 else mx.uint8
    codes = mx.zeros((*rows, quant.code_width(head_dim)), code_dtype)
    if quant.bits == 4:
        codes = codes + 0x88  # both nibbles hold code 0
    scales = mx.zeros((*rows, head_dim // quant.group(head_dim)), SCALE_DTYPE)
    return QuantizedPool(codes, scales, quant.bits)


def quantize(x: mx.array, quant: KVQuant) -> tuple[mx.array, mx.array]:
    """(codes, scales) of rows `x [..., D]` in the pool's layout."""
    head_dim = x.shape[-1]
    group = quant.group(head_dim)
    grouped = x.astype(mx.float32).reshape(*x.shape[:-1], head_dim // group, group)
    scales = (mx.max(mx.abs(grouped), axis=-1) / quant.max_code).astype(SCALE_DTYPE)
    divisor = mx.where(scales > 0, scales, 1).astype(mx.float32)[..., None]
    codes = mx.clip(mx.round(grouped / divisor), -quant.max_code, quant.max_code)
    codes = codes.astype(mx.int32).reshape(x.shape)
    if quant.bits == 8:
        return codes.astype(mx.int8), scales
    biased = (codes + 8).astype(mx.uint8).reshape(*x.shape[:-1], head_dim // 2, 2)
    return biased[..., 0] | (biased[..., 1] << 4), scales


def dequantize(codes: mx.array, scales: mx.array, bits: int,
               dtype: mx.Dtype = mx.float32) -> mx.array:
    """Rows `[..., D]` of `dtype` from their codes and scales."""
    if bits == 8:
        values = codes.astype(mx.float32)
    else:
        low = (codes & 0xF).astype(mx.float32) - 8
        high = (codes >> 4).astype(mx.float32) - 8
        values = mx.stack([low, high], axis=-1).reshape(*codes.shape[:-1], -1)
    groups = scales.shape[-1]
    grouped = values.reshape(*values.shape[:-1], groups, -1)
    out = grouped * scales.astype(mx.float32)[..., None]
    return out.reshape(values.shape).astype(dtype)


def write_quantized(pool: QuantizedPool, new: mx.array, slot_block: mx.array,
                    slot_offset: mx.array) -> QuantizedPool:
    """Scatter rows `new [total_q, kv_heads, D]` into `pool` at the step's slots (in place,
    as `write_kv` does for float pools)."""
    codes, scales = quantize(new, pool.quant)
    pool.codes[slot_block, slot_offset] = codes
    pool.scales[slot_block, slot_offset] = scales
    return pool


def gather_blocks(pool: QuantizedPool, block_ids: mx.array,
                  dtype: mx.Dtype = mx.float32) -> mx.array:
    """`pool[block_ids]` dequantized: `[*block_ids.shape, block_size, kv_heads, D]`."""
    return dequantize(pool.codes[block_ids], pool.scales[block_ids], pool.bits, dtype)


class HostPool(NamedTuple):
    """A quantized pool's codes and scales as numpy views (the CPU attention path)."""

    codes: np.ndarray
    scales: np.ndarray
    bits: int

    @property
    def shape(self) -> tuple[int, int, int, int]:
        blocks, block_size, kv_heads, width = self.codes.shape
        return blocks, block_size, kv_heads, width * 8 // self.bits

    def gather(self, tables: np.ndarray) -> np.ndarray:
        """`pool[tables]` dequantized to float32."""
        codes, scales = self.codes[tables], self.scales[tables].astype(np.float32)
        if self.bits == 8:
            values = codes.astype(np.float32)
        else:
            values = np.empty((*codes.shape[:-1], 2 * codes.shape[-1]), np.float32)
            values[..., 0::2] = (codes & 0xF).astype(np.float32) - 8
            values[..., 1::2] = (codes >> 4).astype(np.float32) - 8
        grouped = values.reshape(*values.shape[:-1], scales.shape[-1], -1)
        grouped *= scales[..., None]
        return values


def host_pool(pool: QuantizedPool) -> HostPool:
    return HostPool(np.asarray(pool.codes), np.asarray(pool.scales), pool.bits)
