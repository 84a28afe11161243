"""Which drafts a step verifies under `never_slower`: those whose expected tokens pay for rows.

A step of R rows (decodes, prefill chunks) does R rows of work in T(R) seconds (StepCost).
Draft position j of a request whose drafts are accepted at rate a per position adds a**j
tokens on average (it counts only if the j - 1 before it were accepted) and one row. The
positions, best first, are taken while they raise the step's expected rate of work:

    d*  = the d that maximizes (R + sum of the d best a**j) / T(R + d)
    d*  = 0 unless that beats R / T(R) by `min_gain` (a margin for noise and misestimates)

A saturated step (T growing in proportion to rows) drafts nothing: a**j < 1 never pays a
whole row. A step past the rows measured so far (StepCost.covers: below the smallest bucket,
above the largest, e.g. a prefill chunk's) drafts nothing either, and so measures them.

With drafts a step may run another path than without (one row a request: the CPU's and
Metal's decode paths), so T(R + d) is read from the steps measured with drafts (`verify`):
below the fewest rows they have, on the line from T(R) to that point; before any, from the
steps without drafts, which lets a draft be tried once and its step measured.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.spec_decode.step_cost import StepCost


@dataclass(frozen=True)
class DraftOffer:
    """One request's candidate drafts: how many it has, at what acceptance rate."""

    num_available: int
    rate: float  # expected acceptance per position, in [0, 1]


def plan_drafts(cost: StepCost, num_rows: int, offers: list[DraftOffer], budget: int,
                min_gain: float = 0.02, verify: StepCost | None = None) -> list[int]:
    """The number of drafts each offer verifies in a step of `num_rows` rows before drafts,
    at most `budget` in all (0 for all when drafting does not pay). `cost`: steps without
    drafts; `verify`: steps with drafts (None: as `cost`)."""
    lengths = [0] * len(offers)
    if budget < 1 or not cost.covers(num_rows):
        return lengths
    base = cost.seconds(num_rows)
    positions = [(offer.rate ** j, i) for i, offer in enumerate(offers)
                 for j in range(1, offer.num_available + 1)]
    positions.sort(key=lambda p: -p[0])  # stable: a request's positions stay in order
    best_d, best_rate, tokens = 0, (1 + min_gain) * num_rows / base, float(num_rows)
    for d, (gain, _) in enumerate(positions[:budget], 1):
        tokens += gain
        rate = tokens / _with_drafts(cost, verify, num_rows, base, num_rows + d)
        if rate > best_rate:
            best_d, best_rate = d, rate
    for _, i in positions[:best_d]:
        lengths[i] += 1
    return lengths


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
