"""The CPU backend's paged attention (numpy, and the compiled decode loops of float32 pools)
against the pure-MLX reference."""

from __future__ import annotations

from unittest import mock

import mlx.core as mx
import numpy as np
import pytest

from kernels_metal.cases import Case, check, grid
from kernels_metal.cpu import attention as cpu_attention
from kernels_metal.cpu import decode as cpu_decode
from kernels_metal.cpu import prefill as cpu_prefill
from kernels_metal.cpu import threads as cpu_threads
from kernels_metal.metadata import AttentionMetadata
from kernels_metal.reference import paged_attention_reference

NUMPY_CASES = [c for c in grid() if c.dtype != mx.bfloat16]


@pytest.mark.parametrize("case", NUMPY_CASES, ids=lambda c: c.name)
def test_matches_the_reference_on_the_kernel_grid(case):
    result = check(cpu_attention.paged_attention_cpu, case)
    assert result.passed, f"max error {result.max_error}"


def shared_prefix_step(shared_blocks: int, own_tokens: list[int], q_lens: list[int],
                       block_size: int = 8, heads: int = 6, kv_heads: int = 2,
                       head_dim: int = 16, seed: int = 0, spare_blocks: int = 2):
    """Requests that all start with the same `shared_blocks` blocks, then their own tokens;
    the pool holds `spare_blocks` more (random, owned by none) after theirs."""
    rng = np.random.default_rng(seed)
    shared = rng.permutation(np.arange(1, 1 + shared_blocks))
    next_block = 1 + shared_blocks
    seq_lens = [shared_blocks * block_size + n for n in own_tokens]
    width = max(-(-s // block_size) for s in seq_lens)
    tables = np.zeros((len(seq_lens), width), np.int32)
    for r, own in enumerate(own_tokens):
        count = -(-own // block_size)
        tables[r, :shared_blocks] = shared
        tables[r, shared_blocks:shared_blocks + count] = np.arange(next_block, next_block + count)
        next_block += count
    shape = (next_block + spare_blocks, block_size, kv_heads, head_dim)
    k, v = (mx.array(rng.standard_normal(shape).astype(np.float32)) for _ in range(2))
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = mx.array(rng.standard_normal((int(cu[-1]), heads, head_dim)).astype(np.float32))
    meta = AttentionMetadata(cu_seqlens_q=cu, seq_lens=np.array(seq_lens, np.int32),
                             block_tables=tables, slot_mapping=np.zeros(int(cu[-1]), np.int64),
                             block_size=block_size)
    return q, k, v, meta, head_dim**-0.5


def assert_matches_reference(q, k, v, meta, scale, window=None, softcap=None, sinks=None):
    """Decode rows both ways: through the compiled loops and through numpy's gathers."""
    expected = paged_attention_reference(q, k, v, meta, scale, window, softcap, sinks)
    for compiled in (True, False):
        with mock.patch.object(cpu_attention, "decodes_compiled",
                               lambda pool, compiled=compiled: compiled):
            got = cpu_attention.paged_attention_cpu(q, k, v, meta, scale, window, softcap, sinks)
        np.testing.assert_allclose(np.array(got), np.array(expected), atol=1e-5, rtol=1e-5)


SINKS = mx.array([3.0, -2.0, 0.5, 8.0, -40.0, 1.0])  # one per query head of the steps here


@pytest.mark.parametrize(("softcap", "sinks"), [(None, None), (15.0, None), (None, SINKS),
                                                (15.0, SINKS)])
def test_decode_rows_share_their_common_prefix_in_one_cascade(softcap, sinks):
    # Five decode requests over 4 shared blocks, one prefill chunk over the same blocks.
    q, k, v, meta, scale = shared_prefix_step(4, [1, 9, 30, 8, 17, 12], [1, 1, 1, 1, 1, 5])
    plan = cpu_attention.build_plan(meta, q.shape[1])
    assert [len(p) for p in plan.prefixes] == [4]
    assert all(s.prefix == 0 for s in plan.slices) and len(plan.chunks) == 1
    assert_matches_reference(q, k, v, meta, scale, softcap=softcap, sinks=sinks)


@pytest.mark.parametrize("window", [None, 10])
def test_sinks_join_windows_and_a_sink_of_minus_infinity_is_none(window):
    q, k, v, meta, scale = shared_prefix_step(3, [4, 20, 33, 9], [1, 1, 1, 17])
    assert_matches_reference(q, k, v, meta, scale, window, sinks=SINKS)
    plain = cpu_attention.paged_attention_cpu(q, k, v, meta, scale, window)
    minus_inf = cpu_attention.paged_attention_cpu(q, k, v, meta, scale, window,
                                                  sinks=mx.full((6,), -mx.inf))
    np.testing.assert_array_equal(np.array(minus_inf), np.array(plain))


def test_requests_with_identical_tables_keep_their_newest_key_out_of_the_shared_part():
    # Two decode rows (n > 1 choices) whose contexts end exactly on a shared block boundary.
    q, k, v, meta, scale = shared_prefix_step(3, [8, 8], [1, 1])
    meta.block_tables[1] = meta.block_tables[0]
    assert [len(p) for p in cpu_attention.build_plan(meta, q.shape[1]).prefixes] == [3]
    assert_matches_reference(q, k, v, meta, scale)


def test_only_the_blocks_all_rows_of_a_group_share_are_shared():
    q, k, v, meta, scale = shared_prefix_step(4, [9, 30, 17], [1, 1, 1])
    meta.block_tables[2, 2:4] = meta.block_tables[2, 4:6]  # the third shares 2 of the 4
    assert [len(p) for p in cpu_attention.build_plan(meta, q.shape[1]).prefixes] == [2]
    assert_matches_reference(q, k, v, meta, scale)
    meta.block_tables[1, 0] = meta.block_tables[1, 6]  # one that shares none goes alone
    plan = cpu_attention.build_plan(meta, q.shape[1])
    assert [len(p) for p in plan.prefixes] == [2]
    assert [s.prefix for s in plan.slices if 1 in s.rows] == [None]
    assert_matches_reference(q, k, v, meta, scale)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [
    (4, 4, 16), (4, 2, 24), (8, 2, 64), (10, 2, 16), (16, 2, 40), (6, 2, 7), (6, 3, 128)])
def test_every_group_size_and_head_size_sums_its_values_alike(heads, kv_heads, head_dim):
    """The value sums run a group's heads four at a time, over vectors of the head, the
    last one masked: groups of 1-8 heads, head sizes that are no whole vector."""
    q, k, v, meta, scale = shared_prefix_step(2, [9, 30, 17], [1, 1, 1], heads=heads,
                                              kv_heads=kv_heads, head_dim=head_dim)
    assert_matches_reference(q, k, v, meta, scale)


def test_decode_rows_that_share_nothing_are_batched_together():
    q, k, v, meta, scale = shared_prefix_step(0, [9, 30, 17, 12, 5], [1, 1, 1, 1, 1])
    plan = cpu_attention.build_plan(meta, q.shape[1])
    assert not plan.prefixes and len(plan.slices) == 1
    assert_matches_reference(q, k, v, meta, scale)


def test_decode_rows_of_two_system_prompts_get_a_cascade_each():
    q, k, v, meta, scale = shared_prefix_step(3, [9, 30, 17, 12, 5], [1, 1, 1, 1, 5],
                                              spare_blocks=3)
    other_prompt = np.arange(meta.block_tables.max() + 1, meta.block_tables.max() + 4)
    meta.block_tables[2:4, :3] = other_prompt  # requests 2 and 3: another system prompt
    plan = cpu_attention.build_plan(meta, q.shape[1])
    assert sorted(len(p) for p in plan.prefixes) == [3, 3]
    assert {s.prefix for s in plan.slices} == {0, 1}
    assert_matches_reference(q, k, v, meta, scale)


def test_a_windowed_layer_scores_no_key_before_the_windows_of_its_rows():
    q, k, v, meta, scale = shared_prefix_step(6, [40, 44, 50], [1, 1, 30])
    window = 10
    plan = cpu_attention.build_plan(meta, q.shape[1], window)
    for s in plan.slices:
        assert s.tables.shape[1] * meta.block_size <= window + 2 * meta.block_size
    assert_matches_reference(q, k, v, meta, scale, window=window)


def test_a_windowed_layer_masks_per_request_instead_of_sharing_blocks():
    q, k, v, meta, scale = shared_prefix_step(4, [3, 20, 11], [1, 1, 4])
    assert not cpu_attention.build_plan(meta, q.shape[1], window=10).prefixes
    assert_matches_reference(q, k, v, meta, scale, window=10)


@pytest.mark.parametrize("window", [None, 12])
def test_a_small_budget_splits_decode_batches_with_the_same_result(monkeypatch, window):
    q, k, v, meta, scale = shared_prefix_step(2, [40, 3, 25, 7, 60], [1, 1, 1, 1, 37])
    whole = np.array(cpu_attention.paged_attention_cpu(q, k, v, meta, scale, window))
    monkeypatch.setattr(cpu_attention, "SCORE_BUDGET", 6 * 160)  # 2 rows of 76 keys
    plan = cpu_attention.build_plan(meta, q.shape[1], window)
    assert len(plan.slices) > 1 and len(plan.chunks) == 1
    assert all(s.prefix is not None for s in plan.slices) == (window is None)
    assert sum(len(s.rows) for s in plan.slices) + plan.chunks[0].count == q.shape[0]
    got = cpu_attention.paged_attention_cpu(q, k, v, meta, scale, window)
    np.testing.assert_allclose(np.array(got), whole, atol=1e-6, rtol=1e-6)
    assert_matches_reference(q, k, v, meta, scale, window)


@pytest.mark.parametrize(("window", "softcap", "sinks"), [(None, None, None), (12, None, None),
                                                          (None, 15.0, SINKS), (5, 15.0, SINKS)])
def test_prefill_chunks_fold_blocks_of_keys_with_the_same_result(monkeypatch, window, softcap,
                                                                 sinks):
    # A chunk after 27 keys, a decode row and a whole 33-token prompt, all after 3 shared
    # blocks; every chunk to cpu_prefill.
    q, k, v, meta, scale = shared_prefix_step(3, [40, 61, 9], [37, 1, 33])
    monkeypatch.setattr(cpu_attention, "COMPILED_PREFILL_SCORES", 0)
    whole = np.array(cpu_attention.paged_attention_cpu(q, k, v, meta, scale, window, softcap,
                                                       sinks))
    folded = []  # (first position, first key, score rows, keys) of each block
    fold = cpu_prefill.fold_block

    def recorded(scores, first_position, last_keys, group, first_key, *args):
        folded.append((first_position, first_key, *scores.shape))
        fold(scores, first_position, last_keys, group, first_key, *args)

    monkeypatch.setattr(cpu_prefill, "fold_block", recorded)
    monkeypatch.setattr(cpu_threads, "threads", lambda: 2)  # two shares of blocks, merged
    monkeypatch.setattr(cpu_prefill, "MIN_BLOCK_KEYS", 16)
    monkeypatch.setattr(cpu_prefill, "MAX_BLOCK_KEYS", 16)
    got = cpu_attention.paged_attention_cpu(q, k, v, meta, scale, window, softcap, sinks)
    np.testing.assert_allclose(np.array(got), whole, atol=1e-6, rtol=1e-6)
    assert all(keys <= 16 for *_, keys in folded) and len(folded) > 4
    # The prompt's first block: every row sees it, unless their windows end before it.
    first_block_rows = next(rows for p, key, rows, _ in folded if p == 0 and key == 0)
    group = q.shape[1] // k.shape[2]  # a KV head's query heads
    assert first_block_rows == group * (33 if window is None else 16 + window - 1)
    assert_matches_reference(q, k, v, meta, scale, window, softcap, sinks)


def test_a_request_and_its_drafts_stay_in_the_compiled_loops_at_a_long_context():
    """A chunk of up to COMPILED_CHUNK_ROWS rows (a decode and its drafts) goes to the
    compiled rows whatever its keys: numpy's path gathered the request's every key first and
    took the step out of the one compiled call. A longer chunk at that context does not."""
    # 9 rows (a token and 8 drafts) and 17 rows, each after ~1000 keys: rows x keys past
    # COMPILED_PREFILL_SCORES for both.
    q, k, v, meta, scale = shared_prefix_step(120, [30, 40], [9, 17])
    assert 9 * int(meta.seq_lens[0]) > cpu_attention.COMPILED_PREFILL_SCORES
    plan = cpu_attention.build_plan(meta, q.shape[1], compiled_decode=True)
    assert list(plan.compiled.rows) == list(range(9))
    assert [chunk.start for chunk in plan.chunks] == [9]
    assert_matches_reference(q, k, v, meta, scale)


def test_fp16_pools_are_read_in_float32_and_bfloat16_is_not_taken():
    case = Case(mx.float16, 64, 16, 6, 2, ((40, 1), (0, 9)))
    assert check(cpu_attention.paged_attention_cpu, case).passed
    q, k, v, meta, scale = shared_prefix_step(3, [5, 20, 9], [1, 1, 4])
    q, k, v = (a.astype(mx.float16) for a in (q, k, v))
    assert [len(p) for p in cpu_attention.build_plan(meta, q.shape[1]).prefixes] == [3]
    got = cpu_attention.paged_attention_cpu(q, k, v, meta, scale)
    f32 = [a.astype(mx.float32) for a in (q, k, v)]
    expected = paged_attention_reference(*f32, meta, scale)
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(expected),
                               atol=1e-3, rtol=4e-3)
    q = mx.zeros((1, 6, 64), mx.bfloat16)
    assert not cpu_attention.supports(q, mx.zeros((4, 16, 2, 64), mx.bfloat16))


@pytest.mark.parametrize("offset", [-200.0, 300.0])
@pytest.mark.parametrize("sinks", [None, SINKS])
def test_rows_whose_scores_would_overflow_or_vanish_are_shifted_by_their_max(offset, sinks):
    # Every score pushed far above exp's range (or far below it) by a constant key component.
    q, k, v, meta, scale = shared_prefix_step(2, [5, 20, 9], [1, 1, 6])
    q = mx.concatenate([q, mx.ones((*q.shape[:2], 1))], axis=-1)
    k = mx.concatenate([k, mx.full((*k.shape[:3], 1), offset / scale)], axis=-1)
    v = mx.concatenate([v, mx.zeros((*v.shape[:3], 1))], axis=-1)
    expected = paged_attention_reference(q, k, v, meta, scale, sinks=sinks)
    got = cpu_attention.paged_attention_cpu(q, k, v, meta, scale, sinks=sinks)
    assert np.isfinite(np.array(got)).all()
    np.testing.assert_allclose(np.array(got), np.array(expected), atol=1e-4, rtol=1e-4)


def test_decode_rows_share_the_threads_only_with_enough_keys(monkeypatch):
    monkeypatch.setattr(cpu_threads, "_threads", 2)
    requests = 16
    rows = cpu_decode.DecodeRows(np.arange(requests), np.arange(requests + 1),
                                 np.zeros((requests, 13), np.int32), np.full(requests, 200),
                                 np.zeros(requests, np.int64))
    assert rows.split(3) == (1, True)
    one = cpu_decode.DecodeRows(np.arange(1), np.arange(2), np.zeros((1, 7), np.int32),
                                np.full(1, 100), np.zeros(1, np.int64))
    assert one.num_keys * 3 < cpu_decode.PARALLEL_FROM
    assert one.split(3) == (1, False)  # too few keys to wake a second thread
    monkeypatch.setattr(cpu_threads, "_threads", 1)
    assert rows.split(3) == (1, False)


@pytest.mark.parametrize(("window", "softcap", "sinks"), [(None, None, None), (None, 15.0, SINKS),
                                                          (50, None, SINKS)])
def test_a_parallel_decode_step_splits_long_contexts_into_key_ranges(monkeypatch, window,
                                                                     softcap, sinks):
    monkeypatch.setattr(cpu_decode, "PARALLEL_FROM", 0)
    monkeypatch.setattr(cpu_decode, "JOBS_PER_THREAD", 8)
    q, k, v, meta, scale = shared_prefix_step(20, [3, 170, 1], [1, 1, 1])
    assert cpu_decode.split_count(len(meta.seq_lens)) > 1
    assert_matches_reference(q, k, v, meta, scale, window, softcap, sinks)


@pytest.mark.parametrize(("head_dim", "block_size"), [(16, 8), (64, 8), (64, 32), (128, 32)])
@pytest.mark.parametrize(("window", "softcap", "sinks"), [(None, None, None), (None, 15.0, SINKS),
                                                          (20, None, SINKS)])
def test_a_requests_rows_share_each_key_range_of_a_parallel_step(monkeypatch, head_dim,
                                                                 block_size, window, softcap,
                                                                 sinks):
    """Rows verifying drafts (or a short chunk's), several a request, each over the keys up
    to its own position (and from its own window's start), scored together a key range at a
    time: the head sizes the dot products are vectorized for (64, 128; a block's keys in
    part of a vector, or in several) and another."""
    monkeypatch.setattr(cpu_decode, "PARALLEL_FROM", 0)
    monkeypatch.setattr(cpu_decode, "SPLIT_KEYS", 16)
    q, k, v, meta, scale = shared_prefix_step(96 // block_size, [3, 70, 1], [3, 9, 1],
                                              block_size=block_size, head_dim=head_dim)
    rows = cpu_attention.compiled_rows(meta, q.shape[1], window)
    assert rows is not None and sorted(np.diff(rows.requests)) == [1, 3, 9]
    assert rows.split(k.shape[2])[0] > 1
    assert_matches_reference(q, k, v, meta, scale, window, softcap, sinks)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
@pytest.mark.parametrize(("window", "sinks"), [(None, None), (6, SINKS)])
def test_the_host_write_and_attend_matches_an_mlx_write_then_the_reference(dtype, window, sinks):
    """The host forward's one call (write K/V rows into the pools' buffers, then attend)
    against MLX's scatter and the pure-MLX reference: same pools after, same outputs."""
    from kernels_metal.attention import write_and_attend
    from kernels_metal.reference import write_kv

    q, k_pool, v_pool, meta, scale = shared_prefix_step(2, [5, 12, 20], [1, 1, 6])
    bs, tables = meta.block_size, meta.block_tables
    q_lens = np.diff(meta.cu_seqlens_q)
    positions = [p for s, n in zip(meta.seq_lens, q_lens, strict=True) for p in range(s - n, s)]
    requests = np.repeat(np.arange(len(q_lens)), q_lens)
    slots = [tables[r, p // bs] * bs + p % bs for r, p in zip(requests, positions, strict=True)]
    meta = AttentionMetadata(meta.cu_seqlens_q, meta.seq_lens, tables,
                             np.array(slots, np.int64), bs)
    rng = np.random.default_rng(7)
    k_new, v_new = (rng.standard_normal((len(slots), *k_pool.shape[2:])).astype(np.float32)
                    for _ in range(2))
    k_pool, v_pool = k_pool.astype(dtype), v_pool.astype(dtype)

    want_k = write_kv(mx.array(k_pool), mx.array(k_new), meta)
    want_v = write_kv(mx.array(v_pool), mx.array(v_new), meta)
    want = paged_attention_reference(q, want_k, want_v, meta, scale, window, sinks=sinks)

    host_k, host_v = mx.array(np.array(k_pool)), mx.array(np.array(v_pool))
    mx.eval(host_k, host_v)
    got, host_k, host_v = write_and_attend(np.array(q), k_new, v_new, host_k, host_v, meta,
                                           scale, window, sinks=sinks)
    assert isinstance(got, np.ndarray)
    np.testing.assert_array_equal(np.array(host_k), np.array(want_k))
    np.testing.assert_array_equal(np.array(host_v), np.array(want_v))
    np.testing.assert_allclose(got, np.array(want), atol=2e-3 if dtype == mx.float16 else 1e-5)


def last_keys_with_images(meta, images: list[tuple[int, int]]) -> np.ndarray:
    """`meta`'s positions with rows `row .. row + length - 1` seeing to the last of them."""
    last_keys = meta.positions.copy()
    for row, length in images:
        last_keys[row:row + length] = last_keys[row + length - 1]
    return last_keys


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("compiled_chunks", [True, False])
def test_rows_inside_an_image_see_its_last_key_as_the_reference(monkeypatch, window,
                                                               compiled_chunks):
    """A chunk with two images (rows 3-9 and 12-14 of its 33) and a decode row; its image rows
    see to their image's end, a window still counting back from the row's own position."""
    q, k, v, meta, scale = shared_prefix_step(3, [40, 61, 9], [37, 1, 33])
    if not compiled_chunks:
        monkeypatch.setattr(cpu_attention, "COMPILED_PREFILL_SCORES", 0)
        monkeypatch.setattr(cpu_prefill, "MIN_BLOCK_KEYS", 16)
        monkeypatch.setattr(cpu_prefill, "MAX_BLOCK_KEYS", 16)
    start = int(meta.cu_seqlens_q[2])
    extended = meta.with_last_keys(last_keys_with_images(meta, [(start + 3, 7),
                                                                (start + 12, 3)]))
    assert_matches_reference(q, k, v, extended, scale, window)
    plain = np.array(paged_attention_reference(q, k, v, meta, scale, window))
    assert not np.allclose(np.array(paged_attention_reference(q, k, v, extended, scale, window)),
                           plain, atol=1e-3)
