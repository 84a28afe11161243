"""Speculative decoding's counters: vLLM's totals, the same per drafting method, and how much
faster the drafting steps ran than the same steps would have without drafts (an estimate)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

# What drafted a request's tokens: its own prompt and outputs (prompt lookup), other
# requests' outputs (the suffix index), a draft model, the checkpoint's MTP head.
DraftSource = Literal["ngram", "suffix", "draft_model", "mtp"]


@dataclass
class MethodCounts:
    num_drafts: int = 0  # steps in which a request drafted this way
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    by_method: dict[DraftSource, MethodCounts] = field(default_factory=dict)
    # Over the timed steps whose rows all sample: their measured seconds, and the seconds
    # their tokens would have taken at one per request and step (a drafting step's by the
    # cost model, a step without drafts as it ran).
    measured_seconds: float = 0.0
    undrafted_seconds: float = 0.0

    def copy(self) -> SpecDecodeStats:
        """A copy another thread may read while this one counts on."""
        return replace(self, accepted_per_position=list(self.accepted_per_position),
                       by_method={m: replace(c) for m, c in self.by_method.items()})

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a drafting step emits per request on average: 1 + accepted per draft."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def speedup_estimate(self) -> float:
        """Undrafted over measured seconds for the same tokens (1.0 before any timed step)."""
        return self.undrafted_seconds / self.measured_seconds if self.measured_seconds else 1.0

    def count(self, source: DraftSource, num_drafts: int, num_accepted: int) -> None:
        """One step verified `num_drafts` drafts of one request, `num_accepted` accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        missing = num_drafts - len(self.accepted_per_position)
        self.accepted_per_position.extend([0] * max(0, missing))
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1
        method = self.by_method.setdefault(source, MethodCounts())
        method.num_drafts += 1
        method.num_draft_tokens += num_drafts
        method.num_accepted_tokens += num_accepted
