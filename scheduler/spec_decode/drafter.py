"""The scheduler's drafter: which running requests draft this step, how many tokens, which ones.

A request drafts only in a step where it decodes (one known or pending token to feed). Its
drafts are the continuation of its known tokens that the n-gram lookup proposes (`ngram`: its
own prompt and outputs; `suffix`: also every other request's outputs), or, with a draft model
or an MTP head, placeholders (DRAFT_TOKEN) that the runner fills on the device in that step.
Behind a step still in flight, the request's last outputs are unknown (a pending token, drafts
being verified): the lookup drafts as if they were what it proposes, i.e. it skips that many
tokens of its continuation; if they turn out otherwise, verification rejects the drafts (the
result is still exact, only slower).

Counters follow vLLM's spec-decode metrics: drafts (steps where a request drafted), draft
tokens, accepted tokens, and accepted tokens by draft position.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from scheduler.request import DRAFT_TOKEN, Request
from scheduler.spec_decode.config import SpeculativeConfig
from scheduler.spec_decode.draft_length import AcceptanceHistory, DraftLength
from scheduler.spec_decode.ngram import NgramProposer, SuffixIndex, pick_draft

if TYPE_CHECKING:
    from scheduler.output import ScheduledRequest


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def copy(self) -> SpecDecodeStats:
        """A copy another thread may read while this one counts on."""
        return replace(self, accepted_per_position=list(self.accepted_per_position))

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a drafting step emits per request on average: 1 + accepted per draft."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class Drafter:
    def __init__(self, config: SpeculativeConfig, token_budget: int, max_model_len: int,
                 draft_room: Callable[[int], int] | None = None) -> None:
        """`draft_room(start)`: the most drafts a step from `start` may verify, where the
        model's state bounds them (hybrid models' checkpoints)."""
        self.config = config
        self.length = DraftLength(config.num_speculative_tokens, token_budget)
        self.suffix = None
        if config.method == "suffix" and config.suffix_decoding_max_cached_requests > 0:
            self.suffix = SuffixIndex(config.prompt_lookup_min, config.prompt_lookup_max,
                                      config.suffix_decoding_max_cached_requests)
        self.max_model_len = max_model_len
        # A draft model or an MTP head drafts on the device: a request whose sampling reads
        # its history on the host (penalties, a grammar) cannot verify drafts the host has
        # not seen.
        self.on_device = config.method in ("draft_model", "mtp")
        self.draft_room = draft_room
        self.stats = SpecDecodeStats()
        self._proposers: dict[str, NgramProposer] = {}
        self._histories: dict[str, AcceptanceHistory] = {}

    def assign(self, scheduled: list[tuple[ScheduledRequest, Request]],
               budget: int) -> Iterator[tuple[ScheduledRequest, Request, list[int]]]:
        """Drafts for the step's decoding requests: as many as the draft-length policy picks
        for the step's load, within the token `budget` left and each request's room."""
        drafting = [(item, request) for item, request in scheduled
                    if self._may_draft(item, request)
                    and not (self.on_device and request.params.needs_token_history)]
        num_rows = sum(len(item.token_ids) for item, _ in scheduled)
        for item, request in drafting:
            k = min(self.length.choose(self._history(request), num_rows=num_rows,
                                       num_drafting=len(drafting)),
                    budget, self._room(item, request))
            drafts = self.propose(request, k) if k > 0 else []
            if drafts:
                budget -= len(drafts)
                yield item, request, drafts

    @staticmethod
    def _may_draft(item: ScheduledRequest, request: Request) -> bool:
        """Decoding, with the base model: drafts come from the base (or text), so a request
        served with a LoRA adapter never drafts. A request that reads its history to sample
        (penalties, a grammar) drafts only with that history known."""
        if not item.samples or len(item.token_ids) != 1 or request.lora_name is not None:
            return False
        return not (request.params.needs_token_history and request.num_unknown_outputs)

    def _room(self, item: ScheduledRequest, request: Request) -> int:
        """Drafts that fit before max_tokens and the context length (a step with k drafts
        may add k + 1 outputs), and within what the model's state allows."""
        room = min(request.params.max_tokens - request.num_output_tokens,
                   self.max_model_len - request.num_tokens) - 1
        if self.draft_room is not None:
            room = min(room, self.draft_room(item.start_position))
        return room

    def propose(self, request: Request, k: int) -> list[int]:
        """Up to k drafts to follow the request's tokens, unknown ones included."""
        if self.on_device:
            return [DRAFT_TOKEN] * k
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
