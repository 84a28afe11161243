"""The Metal kernels' cost model, checked against counts made by hand, and its report in
`metal-serve bench step`."""

from __future__ import annotations

import json

import numpy as np

from kernels_metal.cost import decode_step, step_cost
from kernels_metal.kv_quant import KVQuant
from kernels_metal.metadata import AttentionMetadata
from kernels_metal.plan import PlanOptions
from kernels_metal.prefill import prefill_tile
from server.cli import main

HEADS, KV_HEADS, D, ITEM = 8, 2, 64, 2
KEY_BYTES = 2 * D * ITEM  # a key and its value of one KV head


def test_a_decode_reads_each_key_once_per_kv_head():
    cost = step_cost(decode_step(1, 99), HEADS, KV_HEADS, D, ITEM)
    assert cost.kv_read_bytes == 100 * KV_HEADS * KEY_BYTES  # 99 old keys and its own
    assert cost.kv_write_bytes == 1 * KV_HEADS * KEY_BYTES
    assert cost.flops == 4 * D * HEADS * 100
    assert cost.other_bytes == 2 * HEADS * D * ITEM  # its query in, its output out
    assert cost.dispatches == 1 + 2  # the decode kernel, and a scatter into each pool


def test_split_k_adds_the_partials_and_the_reduce():
    options = PlanOptions(partition_size=32)
    cost = step_cost(decode_step(2, 99), HEADS, KV_HEADS, D, ITEM, options=options)
    parts = 4  # 100 keys in partitions of 32
    assert cost.dispatches == 2 + 2
    partials = 2 * parts * 2 * HEADS * (D + 2) * 4
    assert cost.other_bytes == 2 * 2 * HEADS * D * ITEM + partials
    assert cost.kv_read_bytes == 2 * 100 * KV_HEADS * KEY_BYTES  # split, not re-read


def test_a_window_bounds_the_keys_a_decode_reads():
    cost = step_cost(decode_step(1, 999), HEADS, KV_HEADS, D, ITEM, window=64)
    assert cost.kv_read_bytes == 64 * KV_HEADS * KEY_BYTES


def test_a_quantized_pool_reads_and_writes_its_codes_and_scales():
    plain = step_cost(decode_step(1, 99), HEADS, KV_HEADS, D, ITEM)
    cost = step_cost(decode_step(1, 99), HEADS, KV_HEADS, D, ITEM, kv_quant=KVQuant(4))
    row = D // 2 + D // 32 * 2  # int4 codes, one float16 scale per 32 features
    assert cost.kv_read_bytes == 100 * KV_HEADS * 2 * row
    assert cost.kv_write_bytes == KV_HEADS * 2 * row
    assert (cost.other_bytes, cost.flops) == (plain.other_bytes, plain.flops)  # queries in D


def _step(q_lens: list[int], seq_lens: list[int], block_size: int = 16) -> AttentionMetadata:
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    blocks = -(-max(seq_lens) // block_size)
    tables = np.arange(len(q_lens) * blocks, dtype=np.int32).reshape(len(q_lens), blocks)
    return AttentionMetadata(cu, np.array(seq_lens, np.int32), tables,
                             np.zeros(int(cu[-1]), np.int64), block_size)  # fmt: skip


def test_a_prefill_chunk_loads_whole_key_tiles_and_computes_the_causal_half():
    tile = prefill_tile(ITEM, D)
    cost = step_cost(_step([20], [20]), HEADS, KV_HEADS, D, ITEM)
    block_q = 8 * min(4, 8 // (HEADS // KV_HEADS))  # query rows per tile
    tiles = [(0, min(block_q, 20)), (block_q, 20 - block_q)] if block_q < 20 else [(0, 20)]
    loaded = sum(-(-(first + rows) // tile) * tile for first, rows in tiles)
    assert cost.kv_read_bytes == loaded * KV_HEADS * KEY_BYTES
    assert cost.flops == 4 * D * HEADS * sum(range(1, 21))  # row p sees p + 1 keys


def test_a_mixed_step_pays_for_copying_the_decode_rows_into_place():
    mixed = step_cost(_step([20, 1], [20, 50]), HEADS, KV_HEADS, D, ITEM)
    decode = step_cost(_step([1], [50]), HEADS, KV_HEADS, D, ITEM)
    prefill = step_cost(_step([20], [20]), HEADS, KV_HEADS, D, ITEM)
    assert mixed.kv_read_bytes == decode.kv_read_bytes + prefill.kv_read_bytes
    # No merge pass: the prefill launch copies the decode row into its packed place.
    assert mixed.dispatches == 1 + 1 + 2
    row = HEADS * D * ITEM
    assert mixed.other_bytes == 2 * 21 * row + 2 * 1 * row


def test_bench_step_reports_the_kernel_cost_of_the_default_model(default_model_dir, tmp_path):
    out = tmp_path / "step.json"
    argv = ["bench", "step", str(default_model_dir), "--batch-sizes", "1,16", "--steps", "2",
            "--context-len", "64", "--result-json", str(out)]  # fmt: skip
    assert main(argv) == 0
    costs = json.loads(out.read_text())["metal_kernel_cost_per_decode_step"]
    one, sixteen = costs["1"], costs["16"]
    assert one["layers"] == 30 and one["kv_read_bytes"] > 0
    assert sixteen["kv_read_bytes"] == 16 * one["kv_read_bytes"]  # same context, 16 rows
    assert one["total_bytes"] == one["kv_read_bytes"] + one["kv_write_bytes"] + one["other_bytes"]
