"""Persistent block tables: whatever happened before, a step's rows equal the tables built
from scratch from the scheduler's output."""

from __future__ import annotations

import numpy as np

from metal_engine.block_tables import BlockTables
from scheduler.output import ScheduledRequest
from scheduler.sampling_params import SamplingParams


def scheduled(request_id: str, block_ids: list[int], epoch: int) -> ScheduledRequest:
    return ScheduledRequest(request_id, [1], 0, block_ids, epoch, True, SamplingParams(), 0)


def from_scratch(items: list[ScheduledRequest]) -> np.ndarray:
    width = max(len(s.block_ids) for s in items)
    table = np.zeros((len(items), width), np.int32)
    for i, s in enumerate(items):
        table[i, : len(s.block_ids)] = s.block_ids
    return table


def test_rows_track_appends_restarts_releases_and_growth():
    rng = np.random.default_rng(0)
    tables = BlockTables(rows=2, blocks_per_row=2)  # small, so both dimensions must grow
    live: dict[str, tuple[list[int], int]] = {}
    epoch = 0
    for step in range(300):
        event = rng.random()
        if event < 0.15 or not live:  # a new request
            epoch += 1
            live[f"r{step}"] = ([int(b) for b in rng.integers(0, 999, rng.integers(1, 4))], epoch)
        elif event < 0.25:  # one finishes
            done = str(rng.choice(sorted(live)))
            del live[done]
            tables.release([done])
        elif event < 0.35:  # one is preempted and admitted again: a new table
            rid = str(rng.choice(sorted(live)))
            epoch += 1
            live[rid] = ([int(b) for b in rng.integers(0, 999, rng.integers(1, 6))], epoch)
        for rid, (blocks, e) in live.items():  # some grow by a block
            if rng.random() < 0.3:
                live[rid] = (blocks + [int(rng.integers(0, 999))], e)
        if not live:
            continue
        chosen = [rid for rid in sorted(live) if rng.random() < 0.7] or sorted(live)[:1]
        items = [scheduled(rid, *live[rid]) for rid in chosen]
        np.testing.assert_array_equal(tables.step_table(items), from_scratch(items))
    assert tables.table.shape[0] > 2 and tables.table.shape[1] > 2


def test_a_step_writes_only_the_blocks_appended_since_the_last():
    tables = BlockTables()
    tables.step_table([scheduled("a", [5, 6], 1)])
    (row,) = np.flatnonzero(tables.table[:, 1] == 6)
    tables.table[row, 0] = 99  # not rewritten while the epoch holds
    assert list(tables.step_table([scheduled("a", [5, 6, 7], 1)])[0]) == [99, 6, 7]
    tables.step_table([scheduled("a", [8], 2)])  # a new epoch rewrites the row
    assert list(tables.table[row, :3]) == [8, 0, 0]
