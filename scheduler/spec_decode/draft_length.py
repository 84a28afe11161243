"""How many tokens one request drafts this step: from its acceptance history and the batch load.

Draft position j (from 1) is accepted only if every position before it was, so with a
per-position acceptance rate a it adds a**j tokens on average; it costs one more query row.
A row is almost free while the step is memory-bound (few rows) and costs what a real token
costs once the step is compute-bound (`saturation_rows` or more). So a position is drafted
while its expected gain beats a threshold that rises with the load:

    load      = min(1, rows / saturation_rows)    rows: query rows in the step before drafts
    threshold = min_gain + (1 - min_gain) * load  (a saturated step drafts nothing)
    k         = the largest j <= max_draft with a**j >= threshold, else 0
    k         = min(k, (token_budget - rows) // num_drafting)   drafts share the spare budget

The rate `a` is accepted / tried positions, both as EWMAs: a draft of d tokens of which m are
accepted tried m + 1 positions when m < d (the next one was rejected) and d when m == d.
It starts at `prior`. A request at k = 0 never drafts and so could never raise its rate:
after `probe_every` steps without a draft it drafts one token, unless the step is saturated.
Under `never_slower` the same histories feed draft_plan.py instead (`offer`), the probe being
one token offered at the prior rate.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class AcceptanceHistory:
    """One request's drafts so far (changed only by `DraftLength.record`)."""

    accepted: float  # EWMA of accepted draft tokens per step that drafted
    tried: float  # EWMA of positions those drafts tried
    steps_without_draft: int = 0

    @property
    def rate(self) -> float:
        return self.accepted / self.tried


@dataclass(frozen=True)
class DraftLength:
    max_draft: int  # num_speculative_tokens
    token_budget: int  # the scheduler's max_num_batched_tokens
    saturation_rows: int = 64  # query rows at which a step stops being memory-bound
    min_gain: float = 0.1  # expected tokens a draft position must add in an idle step
    ewma_weight: float = 0.3  # weight of the newest step in the rate
    prior: float = 0.6  # the rate a new request starts with
    probe_every: int = 8  # steps without a draft before a one-token probe

    def __post_init__(self) -> None:
        for name in ("max_draft", "token_budget", "saturation_rows", "probe_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("min_gain", "ewma_weight", "prior"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")

    def new_history(self) -> AcceptanceHistory:
        return AcceptanceHistory(accepted=self.prior, tried=1.0)

    def choose(self, history: AcceptanceHistory, *, num_rows: int, num_drafting: int) -> int:
        """Draft tokens for one request; changes nothing.

        num_rows: query rows the step holds before any draft (a decode is one row, a prefill
        chunk its tokens); num_drafting: requests that may draft in it (they split the spare).
        """
        load = min(1.0, num_rows / self.saturation_rows)
        spare = max(0, self.token_budget - num_rows) // max(1, num_drafting)
        if load >= 1.0 or spare == 0:
            return 0
        threshold = self.min_gain + (1.0 - self.min_gain) * load
        rate, k, gain = history.rate, 0, 1.0
        while k < self.max_draft and gain * rate >= threshold:
            gain *= rate
            k += 1
        if k == 0 and history.steps_without_draft >= self.probe_every:
            k = 1
        return min(k, spare)

    def offer(self, history: AcceptanceHistory, num_available: int) -> tuple[int, float]:
        """What a request offers the cost-aware plan: its drafts at its rate, or one probe
        at the prior rate after `probe_every` steps without a draft at a lower rate."""
        if history.steps_without_draft >= self.probe_every and history.rate < self.prior:
            return min(1, num_available), self.prior
        return num_available, history.rate

    def record(self, history: AcceptanceHistory, num_proposed: int, num_accepted: int) -> None:
        """Fold one step's verification into `history` (num_proposed 0: it did not draft)."""
        if not 0 <= num_accepted <= num_proposed:
            raise ValueError(f"accepted {num_accepted} of {num_proposed} drafted tokens")
        if num_proposed == 0:
            history.steps_without_draft += 1
            return
        tried = num_accepted + (num_accepted < num_proposed)
        w = self.ewma_weight
        history.accepted += w * (num_accepted - history.accepted)
        history.tried += w * (tried - history.tried)
        history.steps_without_draft = 0
