"""K/V pools as bytes: what a block of each kind of pool holds and takes, and the raw bits the
disk tier copies them (and recurrent states) through."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from kernels_metal.kv_quant import KVQuant

if TYPE_CHECKING:
    from scheduler.output import CacheKind

# Unsigned ints of each element size (MLX, numpy): blocks and states travel as raw bits.
RAW_BITS = {4: (mx.uint32, np.uint32), 2: (mx.uint16, np.uint16), 1: (mx.uint8, np.uint8)}


def holds_values(kind: CacheKind) -> bool:
    """Whether a block of a KV pool of cache group `kind` (scheduler.cache_groups) keeps V
    beside K: every kind but "latent", whose one key row a token (MLA's latent) holds the
    values as its first features (models/mla.py)."""
    return kind != "latent"


def bytes_per_block(shapes: Sequence[tuple[int, int]], block_size: int, dtype: mx.Dtype,
                    quant: KVQuant | None = None, kind: CacheKind = "blocks") -> int:
    """One block of every pool of the shapes, pools of group `kind`: K and V (or K only, see
    `holds_values`), as `dtype` elements or `quant`'s codes and scales."""
    parts = 2 if holds_values(kind) else 1
    if quant is not None:
        return parts * block_size * sum(heads * quant.bytes_per_row(dim) for heads, dim in shapes)
    return parts * block_size * sum(heads * dim for heads, dim in shapes) * dtype.size
