"""Continuous batching by token counts: running requests first, then new ones.

There is no prefill or decode phase. Each step a request gets
`min(num_uncomputed_tokens, remaining budget)` tokens; a prompt longer than the budget is
chunked over several steps while running streams keep decoding. Waiting requests are admitted
in the order of the scheduling policy (fcfs or priority); when the pool runs out, the running
request that policy ranks last is preempted and recomputed later.
"""

from __future__ import annotations

from collections.abc import Mapping

from scheduler.block_pool import BlockPool, cdiv
from scheduler.cache_groups import CacheGroup, anchor_for, groups_for
from scheduler.config import SchedulerConfig
from scheduler.kv_connector import KVConnectorScheduler, TierLookup
from scheduler.output import (
    CacheKind,
    RequestUpdate,
    ScheduledRequest,
    SchedulerOutput,
    TokenHistory,
)
from scheduler.prefix_cache import PrefixCache
from scheduler.prefix_hash import BlockHash
from scheduler.request import FinishReason, Request, RequestStatus
from scheduler.spec_decode.drafter import Drafter
from scheduler.stats import RequestState, SchedulerStats
from scheduler.stopping import POOLED, OutputCheck, judge
from scheduler.waiting_queue import WaitingQueue


class Scheduler:
    """Owns request state and the cache groups. Not thread-safe: one engine thread calls it."""

    def __init__(self, config: SchedulerConfig,
                 connector: KVConnectorScheduler | None = None,
                 groups: list[CacheGroup] | None = None) -> None:
        """`connector` (optional): the scheduler side of a KV tier past the pool (the disk),
        which keeps cached blocks the pool evicts, for later hits. `groups`: the cache
        groups beside the anchor's blocks every model has (default: those `config` sizes,
        see groups_for)."""
        self.config = config
        self.connector = connector if config.enable_prefix_caching else None
        anchor = anchor_for(config, self.connector, self._block_evicted)
        beside = groups_for(config, self.connector) if groups is None else groups
        self.groups: list[CacheGroup] = [anchor, *beside]
        self.pool: BlockPool = anchor.pool  # every token's K/V
        self.prefix_cache = PrefixCache(self.groups, config.block_size,
                                        config.enable_prefix_caching, self.connector)
        self.drafter = None
        if config.speculative is not None:
            self.drafter = Drafter(config.speculative, config.max_num_batched_tokens,
                                   config.max_model_len, self._draft_room)
        self.waiting = WaitingQueue(config.scheduling_policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_since_last_step: list[str] = []
        self._arrivals = 0
        self.num_preemptions = 0

    # -- admission ---------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request; raise ValueError if it could never fit the context or the pool,
        or if it has a priority that the fcfs policy would ignore."""
        # A pooling request generates nothing: its prompt may fill the context.
        max_tokens = 0 if request.pooling is not None else request.params.max_tokens
        self.check_fits(request.num_prompt_tokens, max_tokens)
        self.check_priority(request.priority)
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        request.arrival_index = self._arrivals
        self._arrivals += 1
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """`max_tokens` 0: a request that only reads its prompt (it pools)."""
        cfg = self.config
        if num_prompt_tokens + min(max_tokens, 1) > cfg.max_model_len:
            room = " (at least one token must remain for the output)" if max_tokens else ""
            raise ValueError(
                f"the prompt has {num_prompt_tokens} tokens but the context length is "
                f"{cfg.max_model_len}: shorten the prompt{room}"
            )
        worst_case = min(num_prompt_tokens + max_tokens, cfg.max_model_len)
        if cdiv(worst_case, cfg.block_size) > cfg.num_blocks:
            raise ValueError(
                f"the request needs up to {worst_case} tokens of KV cache but the pool holds "
                f"{cfg.num_blocks * cfg.block_size}: lower max_tokens or start the server "
                "with more --kv-cache-memory"
            )

    def check_priority(self, priority: int) -> None:
        if priority != 0 and self.config.scheduling_policy == "fcfs":
            raise ValueError(
                f"the request has priority {priority} but the server schedules first come, "
                "first served: send priority 0 or start the server with "
                "--scheduling-policy priority"
            )

    def group(self, kind: CacheKind) -> CacheGroup | None:
        """The cache group of `kind`, if the model has one."""
        return next((g for g in self.groups if g.kind == kind), None)

    def cached(self) -> dict[CacheKind, list[tuple[int, BlockHash]]]:
        """What each group holds cached: (id, hash) by kind (for the tier, at shutdown)."""
        return {group.kind: group.cached() for group in self.groups}

    def _block_evicted(self, block_hash: BlockHash) -> None:
        """A cached anchor block is being reused: the other groups' data at it goes too."""
        for group in self.groups[1:]:
            group.block_evicted(block_hash)

    def _draft_room(self, start: int) -> int:
        return min(group.draft_room(start) for group in self.groups)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def stats(self) -> SchedulerStats:
        """The scheduler's numbers now, as plain data (about 0.3 us a request)."""
        cache_stats = self.prefix_cache.stats
        states = self.group("states")
        used_slots, num_slots = states.usage() if states is not None else (0, 0)
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_kv_blocks=self.pool.num_blocks,
            num_used_kv_blocks=self.pool.num_used_blocks,
            block_size=self.config.block_size,
            prefix_cache_queried_tokens=cache_stats.queried_tokens,
            prefix_cache_hit_tokens=cache_stats.hit_tokens - cache_stats.stored_hit_tokens,
            has_kv_disk=self.prefix_cache.connector is not None,
            kv_disk_queried_tokens=cache_stats.stored_queried_tokens,
            kv_disk_hit_tokens=cache_stats.stored_hit_tokens,
            num_preemptions=self.num_preemptions,
            spec_decode=self.drafter.stats.copy() if self.drafter is not None else None,
            num_state_slots=num_slots,
            num_used_state_slots=used_slots,
            requests=tuple(
                RequestState(r.request_id, running, r.num_computed_tokens, r.num_cached_tokens,
                             r.num_preemptions)
                for running, queue in ((True, self.running), (False, self.waiting))
                for r in queue),
        )

    def finish_request(self, request_id: str, reason: FinishReason) -> None:
        """End a request now (abort, stop string); its blocks are free for the next step."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status == RequestStatus.WAITING:
            self.waiting.remove(request)
        self._release(request, reason)

    # -- one step ----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Pick this step's tokens: running requests first (oldest first), then waiting ones."""
        out = SchedulerOutput(finished_ids=self._finished_since_last_step)
        self._finished_since_last_step = []
        budget, preempted = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not preempted:  # the pool is short: whatever joins now would be preempted next
            budget = self._schedule_waiting(out, budget)
        if self.drafter is not None and not preempted:  # drafts would take the last blocks
            self._add_drafts(out, budget)
        if self.connector is not None:
            out.kv_plan = self.connector.take_plan()
        for group in self.groups:
            group.take_plan(out)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> tuple[int, bool]:
        """Give each running request its next tokens; return the budget left and whether a
        request had to be preempted for lack of blocks."""
        preempted = False
        for request in list(self.running):
            if budget <= 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted this step to make room for another
            if request.reached_length(self.config.max_model_len):
                continue  # its last token is still being sampled; nothing more to compute
            if request.num_uncomputed_tokens == 0:
                continue  # a pooling request whose pooling step is in flight
            if any(group.holds_back(request) for group in self.groups):
                continue  # e.g. its recurrent state may go back to before the drafts in flight
            num_new = min(request.num_uncomputed_tokens, budget)
            num_new = self._cut(request, request.num_computed_tokens, num_new)
            if num_new == 0:
                continue  # a whole prompt, or its next image, waits for a step with room
            while not self._reserve_blocks(request, num_new):
                # The one the policy would admit last: fcfs, the newest; priority, the lowest.
                victim = max(self.running, key=self.waiting.key)
                budget += self._unschedule(out, victim)
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            if request.status == RequestStatus.RUNNING:
                out.scheduled.append(self._scheduled(request, num_new))
                budget -= num_new
        return budget, preempted

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> int:
        """Admit waiting requests in policy order, each starting after its longest cached prefix.

        A request whose next uncached block a running request is computing is passed over: it
        shares that block once it is cached instead of computing it twice. So is one whose
        stored blocks are still on disk: they are read after this step launches, and it is
        admitted over them next step. Requests behind it may be admitted meanwhile; the first
        that does not fit the pool ends admission. Returns the budget left.
        """
        in_flight = self._blocks_in_flight()
        for request in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if request.has_pending_output:
                continue  # preempted while its last token was being sampled: wait for it
            hits = self.prefix_cache.match(request)
            if self._next_block_in_flight(request, hits, in_flight):
                continue
            hits, stored = self.prefix_cache.lookup_stored(request, hits)
            blocks = stored.of(self.prefix_cache.blocks.kind)
            if self._num_new(request, len(hits) + len(blocks.ready), budget) == 0:
                break  # its whole prompt does not fit what is left of this step
            if not self._can_admit(request, len(hits) + len(blocks.ready) + len(blocks.unread),
                                   budget):
                break
            if not stored.is_ready:  # read once it fits; a block that fails to read is computed
                self.connector.read_ahead(stored)
                continue
            num_new = self._num_new(request, len(hits) + len(blocks.ready), budget)
            self._admit(request, hits, stored, num_new, out)
            in_flight.update(request.block_hashes[request.num_hashed_blocks :])
            budget -= num_new
        return budget

    def _add_drafts(self, out: SchedulerOutput, budget: int) -> None:
        """Give the requests that decode this step the drafts the drafter proposes, where the
        pool can back them without taking blocks from anyone (drafts never preempt) and, for
        a hybrid model, a state slot can hold the snapshot they need."""
        scheduled = [(item, self.requests[item.request_id]) for item in out.scheduled]
        for item, request, drafts, source in self.drafter.assign(scheduled, budget):
            if not self._reserve_blocks(request, 1 + len(drafts)):
                continue
            if not all(group.before_drafts(request) for group in self.groups):
                continue
            item.token_ids = [*item.token_ids, *drafts]
            item.draft_token_ids = drafts
            item.draft_source = source
            item.block_ids = list(request.block_ids)
            item.group_ids = self._group_ids(request)

    def _blocks_in_flight(self) -> set[BlockHash]:
        """Hashes of the full blocks that running requests have yet to compute and cache."""
        return {h for r in self.running for h in r.block_hashes[r.num_hashed_blocks :]}

    @staticmethod
    def _next_block_in_flight(
        request: Request, hits: list[int], in_flight: set[BlockHash]
    ) -> bool:
        # Hashes are chained, so an equal hash means the whole prefix up to it is equal.
        hashes = request.block_hashes
        return len(hits) < len(hashes) and hashes[len(hits)] in in_flight

    def _admit(self, request: Request, hits: list[int], stored: TierLookup, num_new: int,
               out: SchedulerOutput) -> None:
        self.prefix_cache.admit(request, hits, stored)
        reserved = self._reserve_blocks(request, num_new)
        assert reserved, "_can_admit counted the blocks"
        self.waiting.remove(request)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        item = self._scheduled(request, num_new)
        if not request.params.is_basic:  # its sampling reads its history: the runner keeps it
            item.history = TokenHistory(list(request.prompt_token_ids),
                                        list(request.output_token_ids), request.eos_token_ids)
        item.media = request.media
        out.scheduled.append(item)

    def _num_new(self, request: Request, num_cached_blocks: int, budget: int) -> int:
        """Tokens the request computes in its first step after `num_cached_blocks` blocks."""
        num_cached = num_cached_blocks * self.config.block_size
        return self._cut(request, num_cached, min(request.num_tokens - num_cached, budget))

    def _cut(self, request: Request, start: int, num_new: int) -> int:
        """A chunk ends where a group must see a boundary (a hybrid model's checkpoint, an
        image the encoder cannot take in this step, an image's end where images are whole).
        With `whole_prompts` a prompt that does not fit whole gets no chunk (0)."""
        if self.config.whole_prompts:
            return num_new if start + num_new >= request.num_prompt_tokens else 0
        for group in self.groups:
            num_new = group.cut(request, start, num_new)
        return num_new

    def _can_admit(self, request: Request, num_blocks: int, budget: int) -> bool:
        """Whether the request's first step has tokens (its first image may wait for the
        encoder's budget) and every group can back it admitted over `num_blocks` cached
        blocks (the pool's and the tier's). Changes nothing."""
        num_new = self._num_new(request, num_blocks, budget)
        return num_new > 0 and all(group.can_admit(request, num_blocks, num_new)
                                   for group in self.groups)

    def _reserve_blocks(self, request: Request, num_new: int) -> bool:
        return all(group.reserve(request, num_new) for group in self.groups)

    def _group_ids(self, request: Request) -> dict[CacheKind, list[int]]:
        return {group.kind: group.ids(request) for group in self.groups[1:]}

    @staticmethod
    def _unschedule(out: SchedulerOutput, request: Request) -> int:
        """Drop the request's share of this step, if it has one; return its token count."""
        for index, item in enumerate(out.scheduled):
            if item.request_id == request.request_id:
                del out.scheduled[index]
                return len(item.token_ids)
        return 0

    def _preempt(self, request: Request) -> None:
        """Recompute later: release its blocks (cached ones stay findable), queue it again."""
        self.num_preemptions += 1
        request.num_preemptions += 1
        self.running.remove(request)
        self._release_groups(request)
        request.num_computed_tokens = 0
        request.num_hashed_blocks = 0
        request.status = RequestStatus.WAITING
        self.waiting.add(request)

    def _scheduled(self, request: Request, num_new: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        for group in self.groups:
            group.scheduled(request, num_new)
        ends = start + num_new == request.num_tokens
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=request.all_token_ids[start : start + num_new],
            start_position=start,
            block_ids=list(request.block_ids),
            block_table_epoch=request.block_table_epoch,
            samples=ends and request.pooling is None,
            params=request.params,
            num_output_tokens=request.num_output_tokens,
            group_ids=self._group_ids(request),
            token_epoch=request.token_epoch,
            pooling=request.pooling,
            pools=ends and request.pooling is not None,
            lora_name=request.lora_name,
        )

    def advance(self, out: SchedulerOutput) -> None:
        """Count the step's tokens as computed once the step is launched, before its samples
        are known: each sampling request gets a pending output token, which the next step
        may already feed (the runner takes its value from this step's device array)."""
        for item in out.scheduled:
            request = self._request_of(item)
            if request is None:
                continue  # finished since it was scheduled, or its drafts were rejected
            request.num_computed_tokens += len(item.token_ids)
            if item.samples:
                request.append_pending(item.draft_token_ids)

    def observe_step(self, out: SchedulerOutput, seconds: float | None) -> None:
        """A resolved step took `seconds` from schedule to resolve (None: not timed, e.g.
        resolved early); speculative decoding learns what its rows cost from it."""
        if self.drafter is not None:
            self.drafter.observe(out.scheduled, seconds)

    def resolve(self, out: SchedulerOutput, sampled: Mapping[str, int | list[int]],
                checks: Mapping[str, OutputCheck] | None = None) -> list[RequestUpdate]:
        """Fill in a launched step's sampled tokens; finish requests that stop on them.

        `sampled` maps each scheduled request that sampled to its token or, for one that
        verified drafts, to its accepted drafts and the token after them; a request that
        pooled ends (its vector is the runner's). Drafts it rejected
        are dropped with whatever a later step scheduled after them. `checks`: each
        request's checks on its output text and grammar, if it has any (scheduler.stopping).

        Blocks that became full in the step are registered in the prefix cache now, so a
        request admitted next step can share them even while this one still runs.
        """
        updates = []
        for item in out.scheduled:
            request = self._request_of(item)
            if request is None:
                continue  # finished while the step ran, or its drafts were rejected
            tokens = sampled[item.request_id] if item.samples else []
            tokens = [tokens] if isinstance(tokens, int) else list(tokens)
            num_drafts = len(item.draft_token_ids)
            index = item.num_output_tokens
            rejected = item.samples and request.verify_outputs(index, tokens, num_drafts)
            num_computed = item.start_position + len(item.token_ids) - num_drafts
            if item.samples:
                num_computed += len(tokens) - 1  # the accepted drafts' K/V are the drafts'
            if num_drafts and self._drafts_resolved(request, rejected) and rejected:
                num_computed = item.start_position  # a group went back: recompute them
            if request.status == RequestStatus.RUNNING:
                if rejected:
                    request.num_computed_tokens = num_computed
                self.prefix_cache.register(request, num_computed)
            if item.pools:
                updates.append(self._pooled(request))
            if not item.samples:
                continue
            if self.drafter is not None:
                self.drafter.record(request, num_drafts, len(tokens) - 1, item.draft_source)
            check = checks.get(request.request_id) if checks is not None else None
            updates.append(self._stop_check(request, index, tokens, num_drafts, check))
        return updates

    def _stop_check(self, request: Request, index: int, tokens: list[int], num_drafts: int,
                    check: OutputCheck | None) -> RequestUpdate:
        """Judge the new outputs `index ..` in order; the first that stops the request ends
        it, and the ones after it are dropped."""
        kept, stop = judge(request, index, tokens, self.config.max_model_len, check)
        if stop is None:
            return RequestUpdate(request, tokens, None, index + kept, num_drafts)
        request.truncate_outputs(index + kept)
        self.finish_request(request.request_id, stop.reason)
        return RequestUpdate(request, tokens[:kept], stop.reason, index + kept, num_drafts,
                             stop.stop_string, stop.error)

    def _pooled(self, request: Request) -> RequestUpdate:
        self.finish_request(request.request_id, POOLED.reason)
        return RequestUpdate(request, [], POOLED.reason, 0)

    def _request_of(self, item: ScheduledRequest) -> Request | None:
        """The request a step's share belongs to, unless it has finished or dropped the
        tokens that share fed (rejected drafts)."""
        request = self.requests.get(item.request_id)
        if request is None or request.token_epoch != item.token_epoch:
            return None
        return request

    def _drafts_resolved(self, request: Request, rejected: bool) -> bool:
        """Tell every group; whether one went back to before the drafts."""
        went_back = [group.drafts_resolved(request, rejected) for group in self.groups]
        return any(went_back)

    def _release_groups(self, request: Request) -> None:
        """Give back what a request leaving the batch holds in every group."""
        for group in self.groups:
            group.release(request)

    def _release(self, request: Request, reason: FinishReason) -> None:
        request.drop_pending_outputs()
        if self.drafter is not None:
            self.drafter.finish(request)
        self._release_groups(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self._finished_since_last_step.append(request.request_id)
