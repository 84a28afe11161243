"""Which drafts a step verifies under `never_slower`: those whose expected tokens pay for rows.

A step of R rows (decodes, prefill chunks) does R rows of work in T(R) seconds (StepCost).
Draft position j of a request whose drafts are accepted at rate a per position adds a**j
tokens on average (it counts only if the j - 1 before it were accepted) and one row. The
positions, best first, are taken while they raise the step's expected rate of work:

    d*  = the d that maximizes (R + sum of the d best a**j) / T(R + d)
    d*  = 0 unless that beats R / T(R) by `min_gain` (a margin for noise and misestimates)

A saturated step (T growing in proportion to rows) drafts nothing: a**j < 1 never pays a
whole row. A step past the rows measured so far (StepCost.covers: below the smallest bucket
that counts, above the largest, e.g. a prefill chunk's) drafts nothing either, and so
measures them.

With drafts a step may run another path than without (one row a request: the CPU's and
Metal's decode paths), so T(R + d) is read from the steps measured with drafts (`verify`):
below the fewest rows they have, on the line from T(R) to that point; before any, from the
steps without drafts, which lets a draft be tried once and its step measured.

A step that also computes a prefill chunk (`BesidePrefill`) is compute-bound: each row costs
about the same, at most the step's seconds over its rows (measured on steps with chunks,
`cost_with_chunks`). There an accepted draft is worth the decode step's share of a token it
saves later, T(N) / N at the step's N requests, so a position pays where

    a**j * T(N) / N  >=  (1 + min_gain) * T_chunks(R) / R

(~0.1 on this CPU: a row of a 256-row chunk costs ~1.5 ms, a token of 4 decodes ~12 ms). The
prefill rows would otherwise keep every decode in the step to one token.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.spec_decode.step_cost import StepCost


@dataclass(frozen=True)
class DraftOffer:
    """One request's candidate drafts: how many it has, at what acceptance rate."""

    num_available: int
    rate: float  # expected acceptance per position, in [0, 1]


@dataclass(frozen=True)
class BesidePrefill:
    """A step with prefill chunks: what such steps cost by rows, and the requests it holds."""

    cost_with_chunks: StepCost
    num_requests: int


def plan_drafts(cost: StepCost, num_rows: int, offers: list[DraftOffer], budget: int,
                min_gain: float = 0.02, verify: StepCost | None = None,
                prefill: BesidePrefill | None = None) -> list[int]:
    """The number of drafts each offer verifies in a step of `num_rows` rows before drafts,
    at most `budget` in all (0 for all when drafting does not pay). `cost`: decode steps
    without drafts; `verify`: steps with drafts (None: as `cost`); `prefill`: the step
    computes prefill chunks too."""
    lengths = [0] * len(offers)
    positions = [(offer.rate ** j, i) for i, offer in enumerate(offers)
                 for j in range(1, offer.num_available + 1)]
    positions.sort(key=lambda p: -p[0])  # stable: a request's positions stay in order
    gains = [gain for gain, _ in positions[:budget]]
    if prefill is not None:
        best_d = _beside_prefill(cost, prefill, num_rows, gains, min_gain)
    else:
        best_d = _decoding(cost, verify, num_rows, gains, min_gain)
    for _, i in positions[:best_d]:
        lengths[i] += 1
    return lengths


def _beside_prefill(cost: StepCost, prefill: BesidePrefill, num_rows: int,
                    gains: list[float], min_gain: float) -> int:
    """How many of the likeliest positions (their `gains`, best first) pay beside a prefill
    chunk (see the module doc)."""
    n = prefill.num_requests
    decode = cost.seconds(n)  # past the most rows measured: at most the slope so far
    if not gains or decode is None or not prefill.cost_with_chunks.covers(num_rows):
        return 0
    row = prefill.cost_with_chunks.seconds(num_rows) / num_rows
    threshold = (1 + min_gain) * row * n / decode
    return sum(1 for gain in gains if gain >= threshold)


def _decoding(cost: StepCost, verify: StepCost | None, num_rows: int, gains: list[float],
              min_gain: float) -> int:
    """How many of the likeliest positions (their `gains`, best first) raise a decode
    step's rate most."""
    if not gains or not cost.covers(num_rows):
        return 0
    base = cost.seconds(num_rows)
    best_d, best_rate, tokens = 0, (1 + min_gain) * num_rows / base, float(num_rows)
    remaining = sum(gains)
    for d, gain in enumerate(gains, 1):
        seconds = _with_drafts(cost, verify, num_rows, base, num_rows + d)
        if (tokens + remaining) / _least_from(verify, num_rows + d, seconds) <= best_rate:
            break  # not even every position left, at the least time a step ahead costs
        tokens += gain
        remaining -= gain
        rate = tokens / seconds
        if rate > best_rate:
            best_d, best_rate = d, rate
    return best_d


def _least_from(verify: StepCost | None, rows: int, seconds: float) -> float:
    """The least time of a drafting step of `rows` rows or more, `seconds` at `rows`: the
    line below the fewest rows measured with drafts rises to that point's, and from there
    the curve never falls."""
    lowest = verify.lowest() if verify is not None else None
    return min(seconds, lowest[1]) if lowest is not None and rows < lowest[0] else seconds


def _with_drafts(cost: StepCost, verify: StepCost | None, num_rows: int, base: float,
                 rows: int) -> float:
    """T(rows) of a step that verifies drafts, on top of `num_rows` rows costing `base`."""
    lowest = verify.lowest() if verify is not None else None
    if lowest is None:
        return cost.seconds(rows)
    x0, y0 = lowest
    if rows >= x0:
        return verify.seconds(rows)
    if x0 <= num_rows:
        return y0
    return base + (max(y0, base) - base) * (rows - num_rows) / (x0 - num_rows)
