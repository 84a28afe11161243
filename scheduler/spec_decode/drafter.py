"""The scheduler's drafter: which running requests draft this step, how many tokens, which ones.

A request drafts only in a step where it decodes (one known or pending token to feed). Its
drafts are the continuation of its known tokens that the n-gram lookup proposes (`ngram`: its
own prompt and outputs; `suffix`: also every other request's outputs), or, with a draft model
or an MTP head, placeholders (DRAFT_TOKEN) that the runner fills on the device in that step.
Behind a step still in flight, the request's last outputs are unknown (a pending token, drafts
being verified): the lookup drafts as if they were what it proposes, i.e. it skips that many
tokens of its continuation; if they turn out otherwise, verification rejects the drafts (the
result is still exact, only slower).

How many of its drafts a request verifies: with `never_slower`, those that pay for their rows
at the step cost measured on this machine (draft_plan.py, step_cost.py: the engine reports
each step's time to `observe`; looked up only for the requests the plan could take);
otherwise the load-based length (draft_length.py). Both read the request's acceptance
history.

Counters (stats.py) follow vLLM's spec-decode metrics, also per drafting method.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, NamedTuple

from scheduler.request import DRAFT_TOKEN, Request
from scheduler.spec_decode.config import SpeculativeConfig
from scheduler.spec_decode.draft_length import AcceptanceHistory, DraftLength
from scheduler.spec_decode.draft_plan import BesidePrefill, DraftOffer, plan_drafts
from scheduler.spec_decode.ngram import NgramProposer, SuffixIndex, pick_draft
from scheduler.spec_decode.stats import DraftSource, SpecDecodeStats
from scheduler.spec_decode.step_cost import StepCost

if TYPE_CHECKING:
    from scheduler.output import ScheduledRequest


# Steps between the cost models' checks for measurements too old to trust (StepCost.expire).
_EXPIRE_EVERY = 64


class Proposal(NamedTuple):
    token_ids: list[int]
    source: DraftSource


class Drafter:
    def __init__(self, config: SpeculativeConfig, token_budget: int, max_model_len: int,
                 draft_room: Callable[[int], int] | None = None) -> None:
        """`draft_room(start)`: the most drafts a step from `start` may verify, where the
        model's state bounds them (hybrid models' checkpoints)."""
        self.config = config
        self.length = DraftLength(config.num_speculative_tokens, token_budget)
        # Learned for every method (the speed-up estimate); plan drafts under never_slower.
        # Apart: a step with drafts may run another path than a decode-only step of as many
        # rows (the CPU's and Metal's decode paths take one row a request).
        # Decode-only steps, and steps that verify drafts: a bucket counts from its second
        # step (StepCost: outliers). A first verifying step read slow priced out every
        # smaller draft for dozens of steps; until it counts, the plan prices drafts from
        # `cost` and so tries a second.
        self.cost = StepCost(min_steps=2)
        self.verify_cost = StepCost(min_steps=2)
        self.chunk_cost = StepCost()  # steps that compute prefill chunks, with or without drafts
        self.suffix = None
        if config.method == "suffix" and config.suffix_decoding_max_cached_requests > 0:
            self.suffix = SuffixIndex(config.prompt_lookup_min, config.prompt_lookup_max,
                                      config.suffix_decoding_max_cached_requests)
        self.max_model_len = max_model_len
        # A draft model or an MTP head drafts on the device (see `_verifiable`).
        self.on_device = config.method in ("draft_model", "mtp")
        self.draft_room = draft_room
        self.stats = SpecDecodeStats()
        self._proposers: dict[str, NgramProposer] = {}
        self._histories: dict[str, AcceptanceHistory] = {}
        self._accepted_unobserved = 0  # accepted drafts resolved since the last `observe`
        self._num_steps = 0  # steps observed, the cost models' clock

    def assign(self, scheduled: list[tuple[ScheduledRequest, Request]], budget: int
               ) -> Iterator[tuple[ScheduledRequest, Request, list[int], DraftSource]]:
        """Drafts for the step's decoding requests: as many as the policy picks for the
        step's load, within the token `budget` left and each request's room."""
        drafting = [(item, request) for item, request in scheduled
                    if self._may_draft(item, request) and self._verifiable(request)]
        requests = [request for _, request in drafting]
        num_rows = sum(len(item.token_ids) for item, _ in scheduled)
        prefill = None
        if not all(_decodes(item) for item, _ in scheduled):
            prefill = BesidePrefill(self.chunk_cost, len(scheduled))
        caps = [min(self.length.max_draft, budget, self._room(item, request))
                for item, request in drafting]
        if self.config.never_slower and not self.on_device:
            # A lookup costs tens of microseconds a request, most of a 64-request step's host
            # time where nothing pays: look up only where the plan would verify drafts if the
            # lookup found all the request may draft.
            planned = self._lengths(requests, caps, num_rows, budget, prefill)
            caps = [cap if k else 0 for cap, k in zip(caps, planned, strict=True)]
        if self.suffix is not None and any(caps):
            self._index_outputs(request for _, request in scheduled)
        proposals = [self.propose(request, cap) if cap > 0 else None
                     for request, cap in zip(requests, caps, strict=True)]
        available = [len(p.token_ids) if p is not None else 0 for p in proposals]
        lengths = self._lengths(requests, available, num_rows, budget, prefill)
        for (item, request), proposal, k in zip(drafting, proposals, lengths, strict=True):
            if k > 0:
                yield item, request, proposal.token_ids[:k], proposal.source

    def _lengths(self, requests: list[Request], available: list[int], num_rows: int,
                 budget: int, prefill: BesidePrefill | None) -> list[int]:
        """How many of each request's `available` drafts the step verifies (`prefill`: the
        step computes prefill chunks too)."""
        histories = [self._history(request) for request in requests]
        if self.config.never_slower:
            offers = [DraftOffer(*self.length.offer(h, n)) for h, n in zip(histories, available,
                                                                            strict=True)]
            return plan_drafts(self.cost, num_rows, offers, budget, verify=self.verify_cost,
                               prefill=prefill)
        lengths = []
        for history, n in zip(histories, available, strict=True):
            k = min(self.length.choose(history, num_rows=num_rows, num_drafting=len(requests)),
                    n, budget)
            budget -= k
            lengths.append(k)
        return lengths

    def _index_outputs(self, requests: Iterable[Request]) -> None:
        """Bring the shared index up to the requests' known outputs before a lookup (only
        then: a step that looks nothing up indexes nothing, and catches up later at once)."""
        for request in requests:
            num_known = request.num_known_tokens
            if num_known - request.num_prompt_tokens > self.suffix.num_indexed(request.request_id):
                self.suffix.update(request.request_id,
                                   request.all_token_ids[request.num_prompt_tokens:num_known])

    @staticmethod
    def _may_draft(item: ScheduledRequest, request: Request) -> bool:
        """Decoding, with the base model: drafts come from the base (or text), so a request
        served with a LoRA adapter never drafts. A request that reads its history to sample
        (penalties, a grammar) drafts only with that history known."""
        if not _decodes(item) or item.draft_token_ids or request.lora_name is not None:
            return False
        return not (request.params.needs_token_history and request.num_unknown_outputs)

    def _verifiable(self, request: Request) -> bool:
        """Whether drafts on the device fit the request: not where its sampling reads its
        history on the host (penalties, a grammar: it cannot verify drafts the host has not
        seen); under never_slower, only greedy ones, whose tokens stay those of a run without
        drafts (a sampled request's are then equally distributed, not the same)."""
        if not self.on_device:
            return True
        params = request.params
        return not params.needs_token_history and not (self.config.never_slower
                                                       and not params.greedy)

    def _room(self, item: ScheduledRequest, request: Request) -> int:
        """Drafts that fit before max_tokens and the context length (a step with k drafts
        may add k + 1 outputs), and within what the model's state allows."""
        room = min(request.params.max_tokens - request.num_output_tokens,
                   self.max_model_len - request.num_tokens) - 1
        if self.draft_room is not None:
            room = min(room, self.draft_room(item.start_position))
        return room

    def propose(self, request: Request, k: int) -> Proposal:
        """Up to k drafts to follow the request's tokens, unknown ones included. A shorter
        k's proposal is a prefix of a longer one's. Other requests' outputs are those `assign`
        indexed last."""
        if self.on_device:
            return Proposal([DRAFT_TOKEN] * k, self.config.method)
        known = request.all_token_ids[: request.num_known_tokens]
        skip = request.num_unknown_outputs
        proposer = self._proposers.get(request.request_id)
        if proposer is None:
            proposer = self._proposers[request.request_id] = NgramProposer(
                self.config.prompt_lookup_min, self.config.prompt_lookup_max)
        own = proposer.propose(known, skip + k)
        if self.suffix is None:
            return Proposal(pick_draft([own]).token_ids[skip:], "ngram")
        others = self.suffix.propose(known, skip + k)
        draft = pick_draft([own, others],
                           max_spec_factor=self.config.suffix_decoding_max_spec_factor,
                           max_depth=self.config.suffix_decoding_max_tree_depth + skip)
        source = "suffix" if others.match_len > own.match_len else "ngram"
        return Proposal(draft.token_ids[skip:], source)

    def record(self, request: Request, num_drafts: int, num_accepted: int,
               source: DraftSource | None = None) -> None:
        """A step verified `num_drafts` of the request's drafts, drafted by `source`
        (0: it did not draft)."""
        self.length.record(self._history(request), num_drafts, num_accepted)
        if num_drafts:
            self.stats.count(source or self.config.method, num_drafts, num_accepted)
            self._accepted_unobserved += num_accepted

    def observe(self, scheduled: list[ScheduledRequest], seconds: float | None) -> None:
        """The step of `scheduled` took `seconds` (None: not timed) and has been resolved.
        Every timed step teaches the cost model (by its kind); one whose rows all sample
        (decodes and their drafts) also the speed-up estimate."""
        accepted, self._accepted_unobserved = self._accepted_unobserved, 0
        step = self._num_steps = self._num_steps + 1
        if step % _EXPIRE_EVERY == 0:
            for cost in (self.cost, self.verify_cost, self.chunk_cost):
                cost.expire(step)
        if seconds is None or not scheduled:
            return
        rows = sum(len(s.token_ids) for s in scheduled)
        if not all(_decodes(s) for s in scheduled):
            self.chunk_cost.observe(rows, seconds, step)
            return
        (self.cost if rows == len(scheduled) else self.verify_cost).observe(rows, seconds, step)
        # A step without drafts counts as it ran; one with drafts against its tokens at one
        # per request and step (the undrafted curve's price: a step's noise is skewed slow,
        # so only the drafting steps are estimated).
        undrafted = seconds if rows == len(scheduled) else self.cost.seconds(len(scheduled))
        if undrafted is not None:
            self.stats.measured_seconds += seconds
            self.stats.undrafted_seconds += undrafted * (1 + accepted / len(scheduled))

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


def _decodes(item: ScheduledRequest) -> bool:
    """Whether the step feeds the request one token (and any drafts after it) and samples:
    a decode, not a prefill chunk."""
    return item.samples and len(item.token_ids) == 1 + len(item.draft_token_ids)
