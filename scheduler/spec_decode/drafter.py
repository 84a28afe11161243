"""The scheduler's drafter: which running requests draft this step, how many tokens, which ones.

A request drafts only in a step where it decodes (one known or pending token to feed). Its
drafts are the continuation of its known tokens that the n-gram lookup proposes (`ngram`: its
own prompt and outputs; `suffix`: also every other request's outputs). Behind a step still in
flight, the request's last outputs are unknown (a pending token, drafts being verified): it
drafts as if they were what the lookup proposes, i.e. it skips that many tokens of the lookup's
continuation; if they turn out otherwise, verification rejects the drafts (the result is still
exact, only slower).

Counters follow vLLM's spec-decode metrics: drafts (steps where a request drafted), draft
tokens, accepted tokens, and accepted tokens by draft position.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.request import Request
from scheduler.spec_decode.config import SpeculativeConfig
from scheduler.spec_decode.draft_length import AcceptanceHistory, DraftLength
from scheduler.spec_decode.ngram import NgramProposer, SuffixIndex, pick_draft


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a drafting step emits per request on average: 1 + accepted per draft."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class Drafter:
    def __init__(self, config: SpeculativeConfig, token_budget: int) -> None:
        if config.method not in ("ngram", "suffix"):
            raise ValueError(f"--speculative-config: method {config.method!r} is not "
                             "available yet; use ngram or suffix")
        self.config = config
        self.length = DraftLength(config.num_speculative_tokens, token_budget)
        self.suffix = None
        if config.method == "suffix" and config.suffix_decoding_max_cached_requests > 0:
            self.suffix = SuffixIndex(config.prompt_lookup_min, config.prompt_lookup_max,
                                      config.suffix_decoding_max_cached_requests)
        self.stats = SpecDecodeStats()
        self._proposers: dict[str, NgramProposer] = {}
        self._histories: dict[str, AcceptanceHistory] = {}

    def num_tokens(self, request: Request, *, num_rows: int, num_drafting: int) -> int:
        """How many tokens `request` should draft in a step of `num_rows` query rows."""
        return self.length.choose(self._history(request), num_rows=num_rows,
                                  num_drafting=num_drafting)

    def propose(self, request: Request, k: int) -> list[int]:
        """Up to k drafts to follow the request's tokens, unknown ones included."""
        known = request.all_token_ids[: request.num_known_tokens]
        skip = request.num_unknown_outputs
        proposer = self._proposers.get(request.request_id)
        if proposer is None:
            proposer = self._proposers[request.request_id] = NgramProposer(
                self.config.prompt_lookup_min, self.config.prompt_lookup_max)
        drafts = [proposer.propose(known, skip + k)]
        if self.suffix is not None:
            self.suffix.update(request.request_id, known[request.num_prompt_tokens :])
            drafts.append(self.suffix.propose(known, skip + k))
            draft = pick_draft(drafts, max_spec_factor=self.config.suffix_decoding_max_spec_factor,
                               max_depth=self.config.suffix_decoding_max_tree_depth + skip)
        else:
            draft = pick_draft(drafts)
        return draft.token_ids[skip:]

    def record(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """A step verified `num_drafts` of the request's drafts (0: it did not draft)."""
        self.length.record(self._history(request), num_drafts, num_accepted)
        if not num_drafts:
            return
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_drafts
        stats.num_accepted_tokens += num_accepted
        missing = num_drafts - len(stats.accepted_per_position)
        stats.accepted_per_position.extend([0] * max(0, missing))
        for position in range(num_accepted):
            stats.accepted_per_position[position] += 1

    def finish(self, request: Request) -> None:
        """The request ended: drop its index; its outputs stay in the shared one."""
        self._proposers.pop(request.request_id, None)
        self._histories.pop(request.request_id, None)
        if self.suffix is not None:
            self.suffix.update(request.request_id,
                               request.all_token_ids[request.num_prompt_tokens :
                                                     request.num_known_tokens])
            self.suffix.finish(request.request_id)

    def _history(self, request: Request) -> AcceptanceHistory:
        history = self._histories.get(request.request_id)
        if history is None:
            history = self._histories[request.request_id] = self.length.new_history()
        return history
