"""What one step's attention costs on the Metal path, computed from its kernel plan.

Per layer: bytes of K/V the kernels read from the pools (a GQA group reads its KV head once
per threadgroup; the prefill kernel loads whole key tiles, the decode kernel the keys a row
sees; a quantized pool's codes and scales), bytes of new K/V `write_kv` scatters in, the
other traffic (queries, outputs, split-K partials, and in a mixed step the decode rows the
prefill launch copies into place),
multiply-add FLOPs of the useful scores and values, and kernel dispatches. An estimate of
memory traffic, not a measurement: caches, the block-table reads and masked work inside a
tile are left out.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from kernels_metal.kv_quant import KVQuant
from kernels_metal.metadata import AttentionMetadata
from kernels_metal.plan import KernelPlan, PlanOptions, PrefillWork, build_plan
from kernels_metal.prefill import prefill_tile

_PARTIAL_BYTES = 4  # split-K partial outputs and (max, sum) are float32


@dataclass(frozen=True)
class StepCost:
    """Attention cost of one step in one layer."""

    kv_read_bytes: int
    kv_write_bytes: int
    other_bytes: int
    flops: int
    dispatches: int

    def total_bytes(self) -> int:
        return self.kv_read_bytes + self.kv_write_bytes + self.other_bytes

    def to_json(self, layers: int = 1) -> dict:
        per_step = {name: value * layers for name, value in asdict(self).items()}
        return {**per_step, "total_bytes": self.total_bytes() * layers}


def step_cost(meta: AttentionMetadata, num_heads: int, kv_heads: int, head_dim: int,
              itemsize: int, window: int | None = None, options: PlanOptions | None = None,
              kv_quant: KVQuant | None = None,
              value_dim: int | None = None) -> StepCost:
    """The cost of one layer's attention for the step `meta` describes. `itemsize`: of the
    kernels' element type (queries, outputs, staged K/V); `kv_quant`: the pools' quantization
    (None: float pools of `itemsize`); `value_dim`: MLA's latent rows, whose first
    `value_dim` elements are the values (no V pool; every row to the decode kernel)."""
    options = options or PlanOptions()
    if value_dim is not None:
        options = options.every_row_apart()
    plan = build_plan(meta, num_heads, kv_heads, options, window)
    kv_row = kv_quant.bytes_per_row(head_dim) if kv_quant else head_dim * itemsize
    key_bytes = kv_row if value_dim is not None else 2 * kv_row  # a key and its value
    out_dim = value_dim or head_dim
    total_q = int(meta.cu_seqlens_q[-1])
    kv_read = other = flops = dispatches = 0
    if plan.decode is not None:
        keys = _decode_keys(plan)
        kv_read += int(keys.sum()) * kv_heads * plan.decode.chunks * key_bytes
        flops += 2 * (head_dim + out_dim) * num_heads * int(keys.sum())
        dispatches += 1
        if plan.decode.num_parts > 1:  # partials written, then read by the reduce
            partials = plan.decode.num_parts * plan.decode.num_rows * num_heads
            other += 2 * partials * (out_dim + 2) * _PARTIAL_BYTES
            dispatches += 1
    if plan.prefill is not None:
        work = plan.prefill.for_head_dim(head_dim)  # as the launch tiles it
        loaded, seen = _prefill_keys(work, plan.window, prefill_tile(itemsize, head_dim))
        kv_read += loaded * kv_heads * work.chunks * key_bytes
        flops += 4 * head_dim * num_heads * seen
        dispatches += 1
    other += total_q * num_heads * (head_dim + out_dim) * itemsize  # queries in, outputs out
    if plan.decode is not None and plan.prefill is not None:
        other += 2 * plan.decode.num_rows * num_heads * head_dim * itemsize  # copied in
    kv_write = total_q * kv_heads * key_bytes
    dispatches += 1 if value_dim is not None else 2  # write_kv: a scatter into each pool
    return StepCost(kv_read, kv_write, other, flops, dispatches)


def _decode_keys(plan: KernelPlan) -> np.ndarray:
    """Keys each decode row reads: from its window's start (or 0) to its own position."""
    rows = np.array(plan.decode.rows)[: plan.decode.num_rows]
    return rows[:, 2].astype(np.int64) - rows[:, 3]


def _prefill_keys(work: PrefillWork, window: int | None, key_tile: int) -> tuple[int, int]:
    """(keys a threadgroup loads, whole key tiles; keys its rows attend to), over all tiles."""
    tiles = np.array(work.tiles)[: work.num_tiles].astype(np.int64)
    first, count = tiles[:, 4], tiles[:, 3]
    end = first + count  # the last row sees keys up to and including its own position
    start = np.maximum(first - window + 1, 0) if window else np.zeros_like(first)
    loaded = (-(-end // key_tile) - start // key_tile) * key_tile
    positions = [np.arange(f, f + c) for f, c in zip(first, count, strict=True)]
    every = np.concatenate(positions) if positions else np.zeros(0, np.int64)
    seen = np.minimum(every + 1, window) if window else every + 1
    return int(loaded.sum()), int(seen.sum())


def decode_step(num_requests: int, context: int, block_size: int = 16) -> AttentionMetadata:
    """A step of `num_requests` decodes, each with `context` tokens before its new one."""
    seq = context + 1
    blocks = -(-seq // block_size)
    tables = np.arange(num_requests * blocks, dtype=np.int32).reshape(num_requests, blocks)
    slots = tables[:, (seq - 1) // block_size].astype(np.int64) * block_size
    return AttentionMetadata(
        cu_seqlens_q=np.arange(num_requests + 1, dtype=np.int32),
        seq_lens=np.full(num_requests, seq, np.int32),
        block_tables=tables,
        slot_mapping=slots + (seq - 1) % block_size,
        block_size=block_size,
    )
