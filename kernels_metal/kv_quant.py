"""Quantized K/V pools (`--kv-cache-dtype int8|int4`): the layout and its reference math.

Each token's K (or V) row of each KV head is quantized on its own, in groups of `group`
consecutive features with one float16 scale per group, symmetric (no zero point):

    int8  scale = max|x| / 127   code = clip(round(x / scale), -127, 127)   x ~ code * scale
    int4  scale = max|x| / 7.5   code = clip(floor(x / scale), -8, 7)      x ~ (code + .5) scale

(int4's 16 levels sit at half steps, +-0.5 ... +-7.5 scales: all 16 codes in use.) Keys are
first turned by a fixed orthogonal matrix R (`rotation`: a Hadamard one), and the queries by
the same R before attention reads a K pool, so scores are unchanged: R spreads the few
outlier channels keys have over every feature, which the per-row scale would otherwise be set
by (int4 keys cost the default model +7% perplexity unturned). Values are not turned.

A row is written once and never requantized as its block fills, so writes stay a scatter
like the float pools'. Symmetric codes with one float16 scale per group are what the issue's
capacity needs: per element int8 takes 1 + 2/64 bytes (1.94x the blocks of float16 at head
dim 64), int4 0.5 + 2/32 (3.56x); an affine zero point would add 2 bytes a group (1.88x and
3.2x). Codes: int8 `[blocks, block_size, kv_heads, D]` as int8; int4 two per byte, feature
2i in the low nibble, 2i + 1 in the high one, each stored as code + 8.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
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
    def max_level(self) -> float:
        """max|x| in scale units: the outermost level."""
        return 127.0 if self.bits == 8 else 7.5

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
    """One quantized K or V pool: what the layers take, write and read in place of an array.
    A `rotated` pool (K) holds rows turned by `rotation`; attention turns its queries so."""

    codes: mx.array  # [blocks, block_size, kv_heads, D * bits / 8] int8 or uint8
    scales: mx.array  # [blocks, block_size, kv_heads, D / group] float16
    bits: int
    rotated: bool = False

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
               quant: KVQuant, rotated: bool = False) -> QuantizedPool:
    """A pool of zero scales (dequantizes to zeros)."""
    rows = (num_blocks, block_size, kv_heads)
    code_dtype = mx.int8 if quant.bits == 8 else mx.uint8
    codes = mx.zeros((*rows, quant.code_width(head_dim)), code_dtype)
    scales = mx.zeros((*rows, head_dim // quant.group(head_dim)), SCALE_DTYPE)
    return QuantizedPool(codes, scales, quant.bits, rotated)


def quantize(x: mx.array, quant: KVQuant) -> tuple[mx.array, mx.array]:
    """(codes, scales) of rows `x [..., D]` in the pool's layout."""
    head_dim = x.shape[-1]
    group = quant.group(head_dim)
    grouped = x.astype(mx.float32).reshape(*x.shape[:-1], head_dim // group, group)
    scales = (mx.max(mx.abs(grouped), axis=-1) / quant.max_level).astype(SCALE_DTYPE)
    divisor = mx.where(scales > 0, scales, 1).astype(mx.float32)[..., None]
    if quant.bits == 8:
        codes = mx.clip(mx.round(grouped / divisor), -127, 127)
        return codes.astype(mx.int8).reshape(x.shape), scales
    codes = mx.clip(mx.floor(grouped / divisor), -8, 7).astype(mx.int32).reshape(x.shape)
    biased = (codes + 8).astype(mx.uint8).reshape(*x.shape[:-1], head_dim // 2, 2)
    return biased[..., 0] | (biased[..., 1] << 4), scales


def dequantize(codes: mx.array, scales: mx.array, bits: int,
               dtype: mx.Dtype = mx.float32) -> mx.array:
    """Rows `[..., D]` of `dtype` from their codes and scales."""
    if bits == 8:
        values = codes.astype(mx.float32)
    else:
        low = (codes & 0xF).astype(mx.float32) - 7.5
        high = (codes >> 4).astype(mx.float32) - 7.5
        values = mx.stack([low, high], axis=-1).reshape(*codes.shape[:-1], -1)
    groups = scales.shape[-1]
    grouped = values.reshape(*values.shape[:-1], groups, -1)
    out = grouped * scales.astype(mx.float32)[..., None]
    return out.reshape(values.shape).astype(dtype)


def write_quantized(pool: QuantizedPool, new: mx.array, slot_block: mx.array,
                    slot_offset: mx.array) -> QuantizedPool:
    """Scatter rows `new [total_q, kv_heads, D]` into `pool` at the step's slots (in place,
    as `write_kv` does for float pools), turned first if the pool is."""
    codes, scales = quantize(rotate(new, pool.rotated), pool.quant)
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
            values[..., 0::2] = (codes & 0xF).astype(np.float32) - 7.5
            values[..., 1::2] = (codes >> 4).astype(np.float32) - 7.5
        grouped = values.reshape(*values.shape[:-1], scales.shape[-1], -1)
        grouped *= scales[..., None]
        return values


@cache
def rotation(head_dim: int) -> mx.array:
    """`R [D, D]`, orthogonal: Sylvester's Hadamard matrix / sqrt(n) in blocks of the largest
    power of two n dividing D (D = 80: five blocks of 16)."""
    n = head_dim & -head_dim
    block = np.ones((1, 1), np.float32)
    while block.shape[0] < n:
        block = np.block([[block, block], [block, -block]])
    matrix = mx.array(np.kron(np.eye(head_dim // n, dtype=np.float32), block / np.sqrt(n)))
    mx.eval(matrix)  # an array, not a graph, that every later step reads
    return matrix


def rotate(rows: mx.array, rotated: bool) -> mx.array:
    """`rows [..., D]` turned by `rotation(D)` (as float32) if `rotated`, else as they are."""
    if not rotated:
        return rows
    return rows.astype(mx.float32) @ rotation(rows.shape[-1])


def queries_for(q: mx.array, k_pool) -> mx.array:
    """The queries attention scores against `k_pool` with: turned as its keys are."""
    if isinstance(k_pool, QuantizedPool) and k_pool.rotated:
        return rotate(q, True).astype(q.dtype)
    return q


def host_pool(pool: QuantizedPool) -> HostPool:
    return HostPool(np.asarray(pool.codes), np.asarray(pool.scales), pool.bits)
