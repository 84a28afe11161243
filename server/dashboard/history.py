"""The last minutes in fixed intervals: output tokens per second and TTFT / ITL percentiles,
for the dashboard's charts.

Fed on the handlers' event loop by the observations behind /metrics' histograms
(`server.http.metrics.RequestTimer`), so a chart and a histogram never disagree on what a
TTFT was. Only the intervals of the last `NUM_INTERVALS` are kept.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

INTERVAL_S = 5.0
NUM_INTERVALS = 60  # five minutes of charts
SUMMARY_INTERVALS = 12  # the headline percentiles: the last minute
PERCENTILES = (50, 90, 99)


@dataclass
class _Interval:
    index: int  # time.monotonic() // INTERVAL_S at its start
    output_tokens: int = 0
    ttfts: list[float] = field(default_factory=list)
    itls: list[float] = field(default_factory=list)


class RecentActivity:
    """Observations by interval; not thread-safe (one event loop feeds and reads it)."""

    def __init__(self, clock=time.monotonic) -> None:
        self._clock = clock
        self._intervals: deque[_Interval] = deque()
        self._first_index = self._index(clock())

    def add(self, now: float, num_tokens: int, ttft: float | None = None,
            itl: float | None = None) -> None:
        """`num_tokens` new output tokens at `now` (monotonic): the request's first, after
        `ttft` seconds, or ones that came `itl` seconds apart each."""
        interval = self._current(now)
        interval.output_tokens += num_tokens
        if ttft is not None:
            interval.ttfts.append(ttft)
        if itl is not None:
            interval.itls.extend([itl] * num_tokens)

    def points(self) -> list[dict]:
        """One point per closed interval of the window since the server started, oldest
        first, with zeros (and null percentiles) where nothing happened."""
        now_index = self._index(self._clock())
        by_index = {interval.index: interval for interval in self._intervals}
        start = max(self._first_index, now_index - NUM_INTERVALS)
        wall_offset = time.time() - self._clock()
        return [_point(by_index.get(i) or _Interval(i), wall_offset)
                for i in range(start, now_index)]

    def summary(self) -> dict:
        """Percentiles over the closed intervals of the last minute, and the output rate of
        the newest one."""
        now_index = self._index(self._clock())
        first = now_index - SUMMARY_INTERVALS
        recent = [i for i in self._intervals if first <= i.index < now_index]
        last = next((i for i in recent if i.index == now_index - 1), None)
        return {
            "window_s": SUMMARY_INTERVALS * INTERVAL_S,
            "output_tokens_per_s": (last.output_tokens if last else 0) / INTERVAL_S,
            "ttft_s": percentiles([t for i in recent for t in i.ttfts]),
            "itl_s": percentiles([t for i in recent for t in i.itls]),
        }

    def _current(self, now: float) -> _Interval:
        index = self._index(now)
        if not self._intervals or self._intervals[-1].index < index:
            self._intervals.append(_Interval(index))
            while self._intervals[0].index < index - NUM_INTERVALS:
                self._intervals.popleft()
        return self._intervals[-1]

    @staticmethod
    def _index(now: float) -> int:
        return math.floor(now / INTERVAL_S)


def percentiles(values: list[float]) -> dict[str, float] | None:
    """{"p50": ..., "p90": ..., "p99": ...} (numpy's linear method), None without values."""
    if not values:
        return None
    found = np.percentile(np.asarray(values, dtype=np.float64), PERCENTILES)
    return {f"p{p}": float(v) for p, v in zip(PERCENTILES, found, strict=True)}


def _point(interval: _Interval, wall_offset: float) -> dict:
    return {
        "t": (interval.index + 1) * INTERVAL_S + wall_offset,  # the interval's end, Unix time
        "output_tokens_per_s": interval.output_tokens / INTERVAL_S,
        "ttft_s": percentiles(interval.ttfts),
        "itl_s": percentiles(interval.itls),
    }
