"""What a step of r query rows costs on this machine, learned from the steps the engine times.

Whether a draft pays depends on how much one more query row adds to a step: almost nothing
while the step reads weights (few rows, a GPU), a token's worth once it computes (many rows,
or a CPU multiplying rows one at a time), and where the turn comes depends on the machine,
the model and the context. So it is measured: the engine times every step whose rows all
sample (decodes and their drafts, no prefill chunk) and folds it into an EWMA of seconds per
bucket of rows (exact counts up to 16, then buckets ~12% wide), each bucket at its own EWMA
of rows. Then

    seconds(r)  r inside the observed range: linear between the buckets around it
                r below it: None (unknown: a step there runs without drafts and measures it)
                r above it: on at the slope of the two largest buckets (flat with only one,
                    so a draft is tried once and its step measured)

The points are made non-decreasing in rows first: a step never gets cheaper with more rows,
whatever noise the other work on the machine adds.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

EXACT_ROWS = 16  # one bucket per row count up to here
BUCKET_GROWTH = 1.12  # then each bucket spans ~12% more rows than the one before


def bucket_of(rows: int) -> int:
    """The bucket a step of `rows` rows is measured in (rows itself up to EXACT_ROWS)."""
    if rows <= EXACT_ROWS:
        return rows
    return EXACT_ROWS + 1 + int(math.log(rows / EXACT_ROWS, BUCKET_GROWTH))


@dataclass
class _Point:
    rows: float  # EWMA of the rows measured in this bucket
    seconds: float  # EWMA of their steps' seconds


class StepCost:
    """Seconds per step by query rows; `observe` learns, `seconds` predicts (changes nothing)."""

    def __init__(self, ewma_weight: float = 0.2) -> None:
        if not 0 < ewma_weight <= 1:
            raise ValueError(f"ewma_weight must be in (0, 1], got {ewma_weight}")
        self.ewma_weight = ewma_weight
        self._buckets: dict[int, _Point] = {}
        self._curve: tuple[list[float], list[float]] | None = None  # rows, seconds; None: stale

    @property
    def num_observed(self) -> int:
        """Buckets measured so far."""
        return len(self._buckets)

    def observe(self, rows: int, seconds: float) -> None:
        """Fold one measured step of `rows` query rows into its bucket."""
        if rows < 1 or not seconds > 0:
            raise ValueError(f"a step has at least 1 row and takes some time, got {rows} rows "
                             f"in {seconds} s")
        point = self._buckets.get(bucket_of(rows))
        if point is None:
            self._buckets[bucket_of(rows)] = _Point(float(rows), seconds)
        else:
            w = self.ewma_weight
            point.rows += w * (rows - point.rows)
            point.seconds += w * (seconds - point.seconds)
        self._curve = None

    def seconds(self, rows: int) -> float | None:
        """The predicted seconds of a step of `rows` rows; None below what was measured."""
        xs, ys = self._points()
        if not xs or rows < xs[0]:
            return None
        i = bisect.bisect_right(xs, rows)
        if i == len(xs):  # past the largest bucket: on at the last slope (flat with one)
            if len(xs) == 1:
                return ys[0]
            slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
            return ys[-1] + slope * (rows - xs[-1])
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (rows - x0) / (x1 - x0)

    def _points(self) -> tuple[list[float], list[float]]:
        """The buckets in order of rows, seconds made non-decreasing (cached until observed)."""
        if self._curve is None:
            points = sorted(self._buckets.values(), key=lambda p: p.rows)
            xs = [p.rows for p in points]
            ys, top = [], 0.0
            for p in points:
                top = max(top, p.seconds)
                ys.append(top)
            self._curve = (xs, ys)
        return self._curve
