"""Pack a SchedulerOutput into the flat arrays of one forward, with a few numpy operations."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache

import numpy as np

from kernels_metal.metadata import AttentionMetadata
from metal_engine.block_tables import BlockTables
from scheduler.output import ScheduledRequest, SchedulerOutput
from scheduler.request import DRAFT_TOKEN, PENDING_TOKEN


@dataclass(frozen=True)
class StepInputs:
    input_ids: np.ndarray  # [total_q] int32
    positions: np.ndarray  # [total_q] int32
    attention: AttentionMetadata
    # The rows each request that samples draws from: its last row, or the last k + 1 where
    # it verifies k drafts; in request order.
    sample_rows: np.ndarray  # [num_sampling + num_drafts] int32
    sample_request_ids: list[str]
    # Rows that feed a token still being sampled by the step in flight, and their requests.
    pending_rows: np.ndarray  # [num_pending] int32
    pending_request_ids: list[str]
    has_drafts: bool = False
    # Rows whose token the step's draft model proposes (DRAFT_TOKEN placeholders).
    draft_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))


def build_step_inputs(out: SchedulerOutput, block_size: int,
                      tables: BlockTables | None = None,
                      window_tables: BlockTables | None = None) -> StepInputs:
    """Packed token ids, positions and paging metadata for every scheduled request (and,
    for a sliding-window group, through its blocks as `attention.windowed`).

    `tables` and `window_tables` carry block tables over from earlier steps (the serving
    path); without them they are built from scratch.
    """
    scheduled = out.scheduled
    tables = tables if tables is not None else BlockTables(len(scheduled))
    if "window" not in scheduled[0].group_ids:
        window_tables = None  # the step has no sliding-window group
    elif window_tables is None:
        window_tables = BlockTables(len(scheduled), kind="window")
    if all(len(s.token_ids) == 1 for s in scheduled):
        return _one_row_each_step(scheduled, block_size, tables, window_tables)
    q_lens = np.array([len(s.token_ids) for s in scheduled], np.int32)
    starts = np.array([s.start_position for s in scheduled], np.int32)
    cu_seqlens = np.zeros(len(scheduled) + 1, np.int32)
    np.cumsum(q_lens, out=cu_seqlens[1:])
    total = int(cu_seqlens[-1])

    request_of_row = np.repeat(np.arange(len(scheduled)), q_lens)
    positions = (np.arange(total) - cu_seqlens[request_of_row] + starts[request_of_row])
    positions = positions.astype(np.int32)

    block_tables, slots = _paging(tables, scheduled, request_of_row, positions, block_size)
    windowed = None
    if window_tables is not None:
        window_block_tables, window_slots = _paging(window_tables, scheduled, request_of_row,
                                                    positions, block_size)  # fmt: skip
        windowed = AttentionMetadata(cu_seqlens, starts + q_lens, window_block_tables,
                                     window_slots, block_size)  # fmt: skip

    samples = np.array([s.samples for s in scheduled], bool)
    num_drafts = [len(s.draft_token_ids) for s in scheduled]
    has_drafts = any(num_drafts)
    input_ids = np.fromiter((t for s in scheduled for t in s.token_ids), np.int32, count=total)
    pending_rows = np.flatnonzero(input_ids == PENDING_TOKEN).astype(np.int32)
    return StepInputs(
        input_ids=input_ids,
        positions=positions,
        attention=AttentionMetadata(
            cu_seqlens_q=cu_seqlens,
            seq_lens=starts + q_lens,
            block_tables=block_tables,
            slot_mapping=slots,
            block_size=block_size,
            windowed=windowed,
        ),
        sample_rows=_sample_rows(cu_seqlens, samples, num_drafts if has_drafts else None),
        sample_request_ids=[s.request_id for s in scheduled if s.samples],
        pending_rows=pending_rows,
        pending_request_ids=[scheduled[i].request_id for i in request_of_row[pending_rows]],
        has_drafts=has_drafts,
        draft_rows=np.flatnonzero(input_ids == DRAFT_TOKEN).astype(np.int32),
    )


def _one_row_each_step(scheduled: list[ScheduledRequest], block_size: int, tables: BlockTables,
                       window_tables: BlockTables | None) -> StepInputs:
    """`build_step_inputs` of a step of one row a request (decodes): row r is request r's,
    so each array is read off the requests in one pass, without index arithmetic. The row
    lists of the usual step (every row samples; no row or every row pending; no drafts) are
    shared read-only arrays: each numpy call costs a step more than its work here, its code
    gone cold since the last step."""
    cu_seqlens = _one_row_each(len(scheduled))
    every_row = cu_seqlens[:-1]
    starts = [s.start_position for s in scheduled]
    tokens = [s.token_ids[0] for s in scheduled]
    request_ids = [s.request_id for s in scheduled]
    seq_lens = np.array([p + 1 for p in starts], np.int32)

    def metadata(tables: BlockTables, windowed: AttentionMetadata | None) -> AttentionMetadata:
        slots = [ids[p // block_size] * block_size + p % block_size
                 for ids, p in zip(tables.block_ids(scheduled), starts, strict=True)]
        return AttentionMetadata(cu_seqlens, seq_lens, tables.step_table(scheduled),
                                 np.array(slots, np.int64), block_size, windowed=windowed)

    def rows(chosen: list[int]) -> np.ndarray:
        if len(chosen) == len(every_row):
            return every_row
        return np.array(chosen, np.int32) if chosen else _NO_ROWS

    windowed = metadata(window_tables, None) if window_tables is not None else None
    sampling = [r for r, s in enumerate(scheduled) if s.samples]
    pending = [r for r, t in enumerate(tokens) if t == PENDING_TOKEN]
    return StepInputs(
        input_ids=np.array(tokens, np.int32),
        positions=np.array(starts, np.int32),
        attention=metadata(tables, windowed),
        sample_rows=rows(sampling),
        sample_request_ids=[request_ids[r] for r in sampling],
        pending_rows=rows(pending),
        pending_request_ids=[request_ids[r] for r in pending],
        draft_rows=rows([r for r, t in enumerate(tokens) if t == DRAFT_TOKEN]),
    )


_NO_ROWS = np.zeros(0, np.int32)
_NO_ROWS.flags.writeable = False


@cache
def _one_row_each(num_requests: int) -> np.ndarray:
    """`cu_seqlens` of a step of one row a request, read-only and shared by such steps (its
    first `num_requests` entries are also its rows)."""
    cu_seqlens = np.arange(num_requests + 1, dtype=np.int32)
    cu_seqlens.flags.writeable = False
    return cu_seqlens


def _sample_rows(cu_seqlens: np.ndarray, samples: np.ndarray,
                 num_drafts: list[int] | None) -> np.ndarray:
    """Each sampling request's last `1 + drafts` rows, in order (`num_drafts` None: none)."""
    ends = cu_seqlens[1:][samples]
    if num_drafts is None:
        return ends - 1
    counts = np.array(num_drafts, np.int32)[samples] + 1
    offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    return (np.repeat(ends - counts, counts) + offsets).astype(np.int32)


def _paging(tables: BlockTables, scheduled, request_of_row: np.ndarray, positions: np.ndarray,
            block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The step's block tables `[num_reqs, max_blocks]` and each row's KV slot."""
    block_tables = tables.step_table(scheduled)
    slots = (
        block_tables[request_of_row, positions // block_size].astype(np.int64) * block_size
        + positions % block_size
    )
    return block_tables, slots
