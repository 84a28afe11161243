"""What a step of r query rows costs on this machine, learned from the steps the engine times.

Whether a draft pays depends on how much one more query row adds to a step: almost nothing
while the step reads weights (few rows, a GPU), a token's worth once it computes (many rows,
or a CPU multiplying rows one at a time), and where the turn comes depends on the machine,
the model and the context. So it is measured: the engine times every step whose rows all
sample (decodes and their drafts, no prefill chunk), and each bucket of rows (exact counts up
to 16, then buckets ~12% wide) keeps its last few steps. A bucket's point is the fastest of
them at the mean of their rows: a step slowed by a compile or by other work on the machine is
noise (no step runs faster than the machine), and a point read too slow would never be
measured again, since the plan avoids the rows it prices high. So a bucket not measured for
`max_age` steps is forgotten (`expire`): the machine's load moves, and rows priced in a busy
minute get tried again. A curve can also count a bucket only from its second step
(`min_steps`): one step alone may be such an outlier. Priced slow, a bucket of undrafted
steps makes every draft look cheap, so no step of those rows runs undrafted to correct it
(an engine run without the server's warm-up: its first 16-request decode step paid a
compile, 1.0 s against 0.056, and every step of 16 requests then drafted, 0.88-0.93x of
`off`; a busy moment on the machine does the same to a server); a bucket of verifying steps
makes every draft of fewer rows look dear, so none runs to correct it (the drafter's curves:
scheduler/spec_decode/drafter.py). Then

    seconds(r)  r inside the observed range: linear between the points around it
                r in the smallest bucket, below its mean rows: that bucket's point
                r below it: None (unknown)
                r above it: on at the slope of the two largest points (flat with only one,
                    so a draft is tried once and its step measured)

A step's rows before drafts must be `covers`ed (in a bucket that counts, or between two) for
it to draft; otherwise it runs without drafts, and so measures them.

A step never gets cheaper with more rows, so a point above a later one is lowered to it:
slow outliers are the noise here, so the curve trusts the lower of two contradicting points.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque

EXACT_ROWS = 16  # one bucket per row count up to here
BUCKET_GROWTH = 1.12  # then each bucket spans ~12% more rows than the one before


def bucket_of(rows: int) -> int:
    """The bucket a step of `rows` rows is measured in (rows itself up to EXACT_ROWS)."""
    if rows <= EXACT_ROWS:
        return rows
    return EXACT_ROWS + 1 + int(math.log(rows / EXACT_ROWS, BUCKET_GROWTH))


class StepCost:
    """Seconds per step by query rows; `observe` learns, `seconds` predicts (changes nothing)."""

    def __init__(self, window: int = 5, max_age: int = 512, min_steps: int = 1) -> None:
        """`min_steps`: the steps a bucket needs before it counts (at most `window`)."""
        if not 1 <= min_steps <= window or max_age < 1:
            raise ValueError(f"need 1 <= min_steps <= window and max_age >= 1, got "
                             f"{min_steps}, {window}, {max_age}")
        self.window = window
        self.max_age = max_age
        self.min_steps = min_steps
        self._buckets: dict[int, deque[tuple[int, float]]] = {}  # bucket -> (rows, seconds)
        self._last_step: dict[int, int] = {}  # bucket -> the step that last measured it
        self._curve: tuple[list[float], list[float]] | None = None  # rows, seconds; None: stale
        self._counted: set[int] = set()  # the buckets with min_steps steps, with the curve

    def observe(self, rows: int, seconds: float, step: int = 0) -> None:
        """Fold one measured step of `rows` query rows, the engine's `step`-th, into its
        bucket."""
        if rows < 1 or not seconds > 0:
            raise ValueError(f"a step has at least 1 row and takes some time, got {rows} rows "
                             f"in {seconds} s")
        key = bucket_of(rows)
        self._buckets.setdefault(key, deque(maxlen=self.window)).append((rows, seconds))
        self._last_step[key] = step
        self._curve = None

    def expire(self, step: int) -> None:
        """Forget the buckets no step measured in the `max_age` steps before `step`."""
        for key in [k for k, last in self._last_step.items() if step - last > self.max_age]:
            del self._buckets[key], self._last_step[key]
            self._curve = None

    def covers(self, rows: int) -> bool:
        """Whether a step of `rows` rows lies within what was measured (its bucket, or
        between two measured buckets): a step past them is measured before it drafts."""
        xs, _ = self._points()
        return bool(xs) and (xs[0] <= rows <= xs[-1] or bucket_of(rows) in self._counted)

    def seconds(self, rows: int) -> float | None:
        """The predicted seconds of a step of `rows` rows; None below what was measured."""
        xs, ys = self._points()
        if not xs:
            return None
        if rows < xs[0]:  # inside the smallest bucket (below its mean rows): its point
            return ys[0] if bucket_of(rows) == min(self._counted) else None
        i = bisect.bisect_right(xs, rows)
        if i == len(xs):  # past the largest bucket: on at the last slope (flat with one)
            if len(xs) == 1:
                return ys[0]
            slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
            return ys[-1] + slope * (rows - xs[-1])
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (rows - x0) / (x1 - x0)

    def lowest(self) -> tuple[float, float] | None:
        """The point of the fewest rows measured, (rows, seconds); None before any."""
        xs, ys = self._points()
        return (xs[0], ys[0]) if xs else None

    def _points(self) -> tuple[list[float], list[float]]:
        """Each bucket's (mean rows, fastest seconds) in order of rows, the seconds lowered to
        be non-decreasing (cached until the next observation)."""
        if self._curve is None:
            self._counted = {b for b, steps in self._buckets.items()
                             if len(steps) >= self.min_steps}
            buckets = [self._buckets[b] for b in sorted(self._counted)]
            xs = [statistics.fmean(r for r, _ in steps) for steps in buckets]
            ys = [min(t for _, t in steps) for steps in buckets]
            for i in range(len(ys) - 2, -1, -1):
                ys[i] = min(ys[i], ys[i + 1])
            self._curve = (xs, ys)
        return self._curve
