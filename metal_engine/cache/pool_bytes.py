"""K/V pools as bytes: what one block of them takes, and the raw bits the disk tier copies
them (and recurrent states) through."""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from kernels_metal.kv_quant import KVQuant

# Unsigned ints of each element size (MLX, numpy): blocks and states travel as raw bits.
RAW_BITS = {4: (mx.uint32, np.uint32), 2: (mx.uint16, np.uint16), 1: (mx.uint8, np.uint8)}


def bytes_per_block(shapes: Sequence[tuple[int, int]], block_size: int, dtype: mx.Dtype,
                    quant: KVQuant | None = None, values: bool = True) -> int:
    """K and V (without `values`: K only, MLA's latent rows) of one block of every pool:
    `dtype` elements, or `quant`'s codes and scales."""
    parts = 2 if values else 1
    if quant is not None:
        return parts * block_size * sum(heads * quant.bytes_per_row(dim) for heads, dim in shapes)
    return parts * block_size * sum(heads * dim for heads, dim in shapes) * dtype.size
