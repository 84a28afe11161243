"""Block tables kept across steps, so a step writes only what changed.

A decode step adds a block to a request once every `block_size` tokens, so rebuilding every
request's table from Python lists each step is almost all repeated work. Each live request
owns a row of one numpy array; a step copies in only the blocks appended since the request's
last step, or its whole table when the scheduler started it afresh (a new `block_table_epoch`:
admitted again after preemption, when its blocks changed).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from scheduler.output import CacheKind, ScheduledRequest


@dataclass
class _Row:
    index: int
    epoch: int
    num_blocks: int  # entries of the row that are current


class BlockTables:
    """`kind`: the cache group whose tables the rows hold: None for the anchor's (`block_ids`,
    "blocks" or "latent"), or another group of blocks, such as "window" (the sliding-window
    group's, whose entries out of the window may be stale: the window's rows never read them)."""

    def __init__(self, rows: int = 64, blocks_per_row: int = 64,
                 kind: CacheKind | None = None) -> None:
        self.kind = kind
        self.table = np.zeros((rows, blocks_per_row), np.int32)
        self._rows: dict[str, _Row] = {}
        self._free_rows = list(range(rows - 1, -1, -1))

    def release(self, request_ids: list[str]) -> None:
        """Forget finished requests; their rows go to new ones."""
        for request_id in request_ids:
            row = self._rows.pop(request_id, None)
            if row is not None:
                self.table[row.index] = 0
                self._free_rows.append(row.index)

    def step_table(self, scheduled: list[ScheduledRequest]) -> np.ndarray:
        """The scheduled requests' rows, brought up to date, in their order: `[num_reqs,
        max_blocks]` (a copy)."""
        ids = self.block_ids(scheduled)
        width = max(map(len, ids))
        self._fit(width)
        rows = [self._update(s, block_ids) for s, block_ids in zip(scheduled, ids, strict=True)]
        # `take` of whole rows, then the columns: much less numpy than an index of both.
        return self.table.take(rows, axis=0)[:, :width]

    def block_ids(self, scheduled: list[ScheduledRequest]) -> list[list[int]]:
        """Each scheduled request's blocks of this table's group."""
        if self.kind is None:
            return [s.block_ids for s in scheduled]
        return [s.group_ids[self.kind] for s in scheduled]

    def _update(self, s: ScheduledRequest, block_ids: list[int]) -> int:
        row = self._rows.get(s.request_id)
        if row is None:
            row = self._rows[s.request_id] = _Row(self._take_row(), s.block_table_epoch, 0)
        elif row.epoch != s.block_table_epoch:
            self.table[row.index] = 0
            row.epoch, row.num_blocks = s.block_table_epoch, 0
        if len(block_ids) > row.num_blocks:
            self.table[row.index, row.num_blocks : len(block_ids)] = block_ids[row.num_blocks :]
            row.num_blocks = len(block_ids)
        return row.index

    def _take_row(self) -> int:
        if not self._free_rows:
            old = len(self.table)
            self.table = np.concatenate([self.table, np.zeros_like(self.table)])
            self._free_rows = list(range(len(self.table) - 1, old - 1, -1))
        return self._free_rows.pop()

    def _fit(self, num_blocks: int) -> None:
        if num_blocks > self.table.shape[1]:
            wider = np.zeros((len(self.table), max(num_blocks, 2 * self.table.shape[1])), np.int32)
            wider[:, : self.table.shape[1]] = self.table
            self.table = wider
