"""The scheduler's cache manager under random traffic, with no model: KV blocks,
recurrent-state slots and sliding-window blocks are conserved through admission, prefix hits,
chunking, preemption, aborts and steps kept in flight (async scheduling), a windowed group
never frees a block a row still to be computed sees, and nothing is left behind at the end.

A rule-based machine drives a `Scheduler` with small pools, as the engine does: schedule,
`advance` at launch, `resolve` with fake sampled tokens one step later. Prompts share
prefixes (and follow-up turns resend a finished conversation), so prefix hits and state
checkpoint restores happen. After every rule it checks the pools against the requests.
One machine per cache layout: hybrid (spare or scarce state slots; fcfs or priority), a
sliding-window group beside full attention, full attention alone.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from scheduler_helpers import hash_of, resolve_step

from scheduler import Request, RequestStatus, SamplingParams, Scheduler, SchedulerConfig
from scheduler.block_pool import cdiv
from scheduler.cache_groups.sliding_window import NULL_BLOCK
from scheduler.output import SchedulerOutput

BLOCK_SIZE = 4
NUM_BLOCKS = 7
MAX_NUM_SEQS = 3
MAX_MODEL_LEN = 24  # 6 blocks: two long requests do not fit the pool together
EOS = 0
# Shared prefixes: a 2-block "system prompt", its first block, and an unrelated block.
PREFIXES = ([1, 2, 3, 1, 2, 3, 1, 2], [1, 2, 3, 1], [3, 3, 2, 2], [])
MAX_STEPS_WITHOUT_A_FINISH = 100  # a request needs at most MAX_MODEL_LEN steps alone

tokens = st.sampled_from((1, 2, 3, 1, 2, 3, EOS))  # the fake sampler's vocabulary


def check_held(pool, block_ids, tables: list[list[int]], requests: list[Request],
               full_tables: list[list[int]] | None = None) -> Counter:
    """Each block's refcount is the number of `tables` (one per running request, null
    entries left out) holding it; a block in two tables is a cached prefix block, at the
    same index of both, under their common hash. Return the holders per block."""
    holders = Counter(b for table in tables for b in table)
    assert all(len(set(table)) == len(table) for table in tables)
    for block_id in block_ids:
        assert pool.refcount(block_id) == holders[block_id]
    for block_id, block_hash in pool.cached_blocks():
        assert pool.lookup(block_hash) == block_id
    for request, table in zip(requests, full_tables or tables, strict=True):
        for index, block_id in enumerate(table):
            if holders[block_id] > 1:
                assert hash_of(pool, block_id) == request.block_hashes[index], "shared unequal"
    return holders


class CacheManagerMachine(RuleBasedStateMachine):
    """A hybrid model's scheduler: a live slot per running request plus checkpoints."""

    NUM_STATE_SLOTS = 3 * MAX_NUM_SEQS
    POLICY = "fcfs"
    NUM_WINDOW_BLOCKS, WINDOW = 0, None

    def __init__(self) -> None:
        super().__init__()
        self.config = SchedulerConfig(
            num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_num_seqs=MAX_NUM_SEQS,
            max_num_batched_tokens=8, max_model_len=MAX_MODEL_LEN, enable_prefix_caching=True,
            num_state_slots=self.NUM_STATE_SLOTS, state_checkpoint_interval=2,
            scheduling_policy=self.POLICY, num_window_blocks=self.NUM_WINDOW_BLOCKS,
            window=self.WINDOW,
        )  # fmt: skip
        self.scheduler = Scheduler(self.config)
        self.in_flight: SchedulerOutput | None = None  # launched, its tokens not yet known
        self.added: dict[str, Request] = {}
        self.histories: list[list[int]] = []  # finished conversations, for follow-up turns
        self.num_restores = 0

    @property
    def hybrid(self) -> bool:
        return self.config.num_state_slots > 0

    @property
    def windowed(self) -> bool:
        return self.config.num_window_blocks > 0

    def first_seen(self, position: int) -> int:
        """The first block a windowed row at `position` (or after it) reads keys from."""
        return max(position - self.WINDOW + 1, 0) // BLOCK_SIZE

    # -- rules ---------------------------------------------------------------------------------

    @rule(base=st.integers(0, 9), tail=st.lists(st.sampled_from((1, 2, 3)), max_size=8),
          max_tokens=st.integers(1, 10), salted=st.booleans(), n=st.integers(1, 2),
          priority=st.integers(0, 2))  # fmt: skip
    def add(self, base, tail, max_tokens, salted, n, priority):
        """`n` requests of a prompt made of a shared prefix or a finished conversation, and
        a few tokens (and a priority, if the policy has them)."""
        sources = list(PREFIXES) + self.histories
        prompt = (sources[base % len(sources)] + tail)[: MAX_MODEL_LEN - 2] or [1]
        for _ in range(n):
            rid = f"r{len(self.added)}"
            request = Request(rid, prompt, SamplingParams(max_tokens=max_tokens),
                              eos_token_ids=(EOS,), cache_salt="other" if salted else None,
                              priority=priority if self.POLICY == "priority" else 0)
            self.scheduler.add_request(request)
            self.added[rid] = request

    @rule(sampled=st.lists(tokens, min_size=MAX_NUM_SEQS, max_size=MAX_NUM_SEQS))
    def step(self, sampled):
        """The async engine's step: schedule and launch step N+1, then resolve step N."""
        out = self.schedule()
        if not out.is_empty:
            self.scheduler.advance(out)
        self.resolve_in_flight(sampled)
        self.in_flight = None if out.is_empty else out

    @precondition(lambda self: self.in_flight is not None)
    @rule(sampled=st.lists(tokens, min_size=MAX_NUM_SEQS, max_size=MAX_NUM_SEQS))
    def step_resolving_first(self, sampled):
        """The async engine's step when a sampler needs the token in flight: schedule step
        N+1, resolve step N, then launch N+1."""
        out = self.schedule()
        self.resolve_in_flight(sampled)
        if not out.is_empty:
            self.scheduler.advance(out)
        self.in_flight = None if out.is_empty else out

    @rule(sampled=st.lists(tokens, min_size=MAX_NUM_SEQS, max_size=MAX_NUM_SEQS))
    def sync_step(self, sampled):
        """The synchronous engine's step: nothing stays in flight."""
        self.resolve_in_flight(sampled)
        out = self.schedule()
        self.scheduler.advance(out)
        self.scheduler.resolve(out, self.fake_samples(out, sampled))

    @precondition(lambda self: self.scheduler.requests)
    @rule(index=st.integers(0, 20), reason=st.sampled_from(("abort", "stop")))
    def finish(self, index, reason):
        """A client disconnects, or the engine matched a stop string."""
        request_ids = sorted(self.scheduler.requests)
        self.scheduler.finish_request(request_ids[index % len(request_ids)], reason)
        self.note_finished()

    @rule()
    def drain(self):
        """Run every request to its end: then every block and slot is free."""
        idle = 0  # steps since a request last finished
        while self.scheduler.has_unfinished_requests() or self.in_flight is not None:
            num_unfinished = len(self.scheduler.requests)
            self.step([1] * MAX_NUM_SEQS)
            self.check_everything()
            idle = 0 if len(self.scheduler.requests) < num_unfinished else idle + 1
            assert idle < MAX_STEPS_WITHOUT_A_FINISH, (
                f"no request finished in {idle} steps: {sorted(self.scheduler.requests)}")
        assert self.scheduler.pool.num_free_blocks == NUM_BLOCKS
        assert all(self.scheduler.pool.refcount(b) == 0 for b in range(NUM_BLOCKS))
        if self.hybrid:
            assert self.scheduler.group("states").num_free_slots == self.config.num_state_slots
        if self.windowed:  # all back but the null block
            window = self.scheduler.group("window")
            assert window.num_free_blocks == self.config.num_window_blocks - 1

    def teardown(self):
        self.drain()

    # -- driving the scheduler -----------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """`schedule()`, checking its output against the pools as they were before it: the
        checkpoints, and the running requests with their live slots (`slots_before`)."""
        checkpoints = {}
        if self.hybrid:
            checkpoints = dict(self.scheduler.group("states").cached())
        slots_before = {r.request_id: self.live_slot(r) for r in self.scheduler.running}
        out = self.scheduler.schedule()
        self.check_output(out, checkpoints, slots_before)
        return out

    @staticmethod
    def fake_samples(out: SchedulerOutput, sampled: list[int]) -> dict[str, int]:
        rids = [item.request_id for item in out.scheduled if item.samples]
        return {rid: sampled[i % len(sampled)] for i, rid in enumerate(rids)}

    def resolve_in_flight(self, sampled: list[int]) -> None:
        if self.in_flight is not None:
            self.scheduler.resolve(self.in_flight, self.fake_samples(self.in_flight, sampled))
            self.in_flight = None
        self.note_finished()

    def note_finished(self) -> None:
        """Keep finished conversations (a few) for follow-up turns to resend."""
        for rid, request in list(self.added.items()):
            if rid not in self.scheduler.requests and request.all_token_ids not in self.histories:
                self.histories = (self.histories + [list(request.all_token_ids)])[-6:]

    # -- the step's plan -----------------------------------------------------------------------

    def check_output(self, out: SchedulerOutput, checkpoints: dict[int, bytes],
                     slots_before: dict[str, int | None]) -> None:
        """Each scheduled request runs in its own blocks (and state slot); a newly admitted
        one starts after its cached prefix, whose state is restored from the checkpoint at
        its end; saves copy a scheduled request's live slot into a slot it holds pending."""
        scheduled = {item.request_id: item for item in out.scheduled}
        assert len(scheduled) == len(out.scheduled)
        requests = self.scheduler.requests
        for rid, item in scheduled.items():
            request = requests[rid]
            assert request.status == RequestStatus.RUNNING
            assert item.block_ids == request.block_ids
            assert item.start_position == request.num_computed_tokens
            end = item.start_position + len(item.token_ids)
            assert len(item.block_ids) == cdiv(end, BLOCK_SIZE)
            if rid not in slots_before and item.start_position:  # a prefix hit
                assert item.start_position % BLOCK_SIZE == 0
                for i in range(item.start_position // BLOCK_SIZE):
                    block_hash = hash_of(self.scheduler.pool, item.block_ids[i])
                    assert block_hash == request.block_hashes[i]
        self.check_window_tables(out, slots_before)
        if not self.hybrid:
            assert out.state_plan.is_empty
            assert all("states" not in item.group_ids for item in out.scheduled)
            return
        by_slot = {item.group_ids["states"][0]: item for item in out.scheduled}
        assert None not in by_slot and len(by_slot) == len(out.scheduled)
        assert all(self.live_slot(requests[rid]) == item.group_ids["states"][0]
                   for rid, item in scheduled.items())
        self.check_restores(out, checkpoints, slots_before, by_slot)
        self.check_saves(out, by_slot)

    def check_restores(self, out, checkpoints, slots_before, by_slot) -> None:
        restored = set()
        for source, target in out.state_plan.restores:
            item = by_slot.get(target)
            assert item is not None, f"a restore into slot {target}, no scheduled request's"
            request = self.scheduler.requests[item.request_id]
            assert item.request_id not in slots_before, "only an admission restores"
            assert item.start_position > 0 and item.start_position % BLOCK_SIZE == 0
            expected = request.block_hashes[item.start_position // BLOCK_SIZE - 1]
            assert checkpoints.get(source) == expected, "restored from another boundary's state"
            assert target not in restored
            restored.add(target)
        self.num_restores += len(restored)
        for slot, item in by_slot.items():  # a cached prefix is restored, an uncached one not
            admitted = item.request_id not in slots_before
            assert (slot in restored) == (admitted and item.start_position > 0), (
                f"{item.request_id} resumes at {item.start_position} without its state")

    def check_saves(self, out, by_slot) -> None:
        targets = set()
        for source, target in out.state_plan.saves:
            item = by_slot.get(source)
            assert item is not None, f"a save from slot {source}, no scheduled request's"
            request = self.scheduler.requests[item.request_id]
            boundary = item.start_position + len(item.token_ids)
            assert boundary % BLOCK_SIZE == 0
            assert any(p.slot == target and p.boundary == boundary
                       for p in self.pending_saves(request))
            assert self.scheduler.group("states").pool.refcount(target) == 1
            assert target not in targets and target not in by_slot
            targets.add(target)

    def check_window_tables(self, out: SchedulerOutput, slots_before) -> None:
        """Each scheduled request's window table holds exactly the blocks its rows see (the
        ones before are null); a prefix hit took the cached blocks of those it needs."""
        if not self.windowed:
            assert all("window" not in item.group_ids for item in out.scheduled)
            return
        window = self.scheduler.group("window")
        for item in out.scheduled:
            request, table = self.scheduler.requests[item.request_id], item.group_ids["window"]
            first = self.first_seen(item.start_position)
            assert table == window.ids(request) and len(table) == len(item.block_ids)
            assert all(b == NULL_BLOCK for b in table[:first]), "holds blocks out of its window"
            assert NULL_BLOCK not in table[first:], "a block its rows see was freed"
            if item.request_id not in slots_before:  # admitted: a hit's blocks are cached
                for i in range(first, item.start_position // BLOCK_SIZE):
                    assert hash_of(window.pool, table[i]) == request.block_hashes[i]

    # -- what the groups hold for a request -----------------------------------------------------

    def live_slot(self, request: Request) -> int | None:
        held = self._slots(request)
        return None if held is None else held.live

    def pending_saves(self, request: Request) -> list:
        held = self._slots(request)
        return [] if held is None else held.pending_saves

    def _slots(self, request: Request):
        states = self.scheduler.group("states")
        return None if states is None else states.slots.get(request.request_id)

    def window_table(self, request: Request) -> list[int]:
        window = self.scheduler.group("window")
        return [] if window is None else window.ids(request)

    # -- invariants ----------------------------------------------------------------------------

    @invariant()
    def pools_match_requests(self):
        self.check_everything()

    def check_everything(self) -> None:
        self.check_request_sets()
        self.check_blocks()
        if self.hybrid:
            self.check_slots()
            self.check_checkpoints()
        else:
            assert self.scheduler.group("states") is None
        if self.windowed:
            self.check_window_blocks()
        else:
            assert self.scheduler.group("window") is None

    def check_request_sets(self) -> None:
        """Running and waiting partition the unfinished requests; only running ones hold
        blocks or a slot."""
        s = self.scheduler
        running, waiting = {r.request_id for r in s.running}, {r.request_id for r in s.waiting}
        assert len(running) == len(s.running) <= MAX_NUM_SEQS and len(waiting) == len(s.waiting)
        assert not running & waiting and running | waiting == set(s.requests)
        for rid, request in self.added.items():
            if rid in running:
                assert request.status == RequestStatus.RUNNING
                continue
            status = RequestStatus.WAITING if rid in waiting else RequestStatus.FINISHED
            assert request.status == status
            left = (request.block_ids, self.live_slot(request), self.pending_saves(request),
                    self.window_table(request))
            assert left == ([], None, [], []), f"{rid} ({status.name}) holds {left}"
            if status == RequestStatus.WAITING:
                assert request.num_computed_tokens == 0

    def check_blocks(self) -> None:
        """Each block's refcount is the number of running requests holding it; the free ones
        are exactly those with none; each table covers its request's computed tokens."""
        pool = self.scheduler.pool
        for request in self.scheduler.running:
            assert len(request.block_ids) == cdiv(request.num_computed_tokens, BLOCK_SIZE)
        tables = [r.block_ids for r in self.scheduler.running]
        holders = check_held(pool, range(NUM_BLOCKS), tables, self.scheduler.running)
        assert pool.num_free_blocks == NUM_BLOCKS - len(holders)
        assert pool.num_free_blocks + pool.num_used_blocks == NUM_BLOCKS

    def check_window_blocks(self) -> None:
        """The window group's blocks as `check_blocks` has the KV blocks (the null block is
        held for good); a running request's table still holds what its next rows see."""
        window, running = self.scheduler.group("window"), self.scheduler.running
        num_blocks = self.config.num_window_blocks
        for request in running:
            table = window.ids(request)
            assert len(table) == len(request.block_ids)
            assert NULL_BLOCK not in table[self.first_seen(request.num_computed_tokens):]
        tables = [[b for b in window.ids(r) if b != NULL_BLOCK] for r in running]
        holders = check_held(window.pool, range(1, num_blocks), tables, running,
                             [window.ids(r) for r in running])  # fmt: skip
        assert window.pool.refcount(NULL_BLOCK) == 1
        assert window.num_free_blocks == num_blocks - 1 - len(holders)

    def check_slots(self) -> None:
        """Every slot is live (one running request's), pending (a save in flight) or free."""
        states = self.scheduler.group("states")
        live = [self.live_slot(r) for r in self.scheduler.running]
        pending = [p.slot for r in self.scheduler.running for p in self.pending_saves(r)]
        assert None not in live
        held = live + pending
        assert len(set(held)) == len(held), f"a slot is held twice: live {live}, pending {pending}"
        for slot in range(self.config.num_state_slots):
            assert states.pool.refcount(slot) == (1 if slot in held else 0)
        assert states.num_free_slots == self.config.num_state_slots - len(held)

    def check_checkpoints(self) -> None:
        """A checkpoint is a free slot that its hash maps back to, and the KV block of that
        hash is still in the pool (state and blocks hit together)."""
        states, pool = self.scheduler.group("states"), self.scheduler.pool
        for slot, block_hash in states.cached():
            assert states.pool.lookup(block_hash) == slot
            assert states.pool.refcount(slot) == 0
            assert pool.lookup(block_hash) is not None, "a checkpoint outlived its block"


class ScarceSlotsMachine(CacheManagerMachine):
    """As few state slots as allowed: a checkpoint waits for a slot no request runs in."""

    NUM_STATE_SLOTS = MAX_NUM_SEQS


class PriorityMachine(CacheManagerMachine):
    """Preemption by priority: the victim may be a request planned earlier in the step."""

    POLICY = "priority"


class WindowedMachine(CacheManagerMachine):
    """Sliding-window layers beside full ones (no recurrent state), with a window group
    small enough that it, too, preempts: 6 usable blocks, where one request's window and
    chunk take up to 5."""

    NUM_STATE_SLOTS = 0
    NUM_WINDOW_BLOCKS, WINDOW = 7, 6


class AttentionOnlyMachine(CacheManagerMachine):
    """No recurrent state: blocks alone are conserved."""

    NUM_STATE_SLOTS = 0


SETTINGS = settings(max_examples=100, stateful_step_count=40, deadline=None,
                    derandomize=True, database=None)  # fmt: skip
TestHybridCacheManager = CacheManagerMachine.TestCase
TestHybridCacheManager.settings = SETTINGS
TestScarceStateSlots = ScarceSlotsMachine.TestCase
TestScarceStateSlots.settings = SETTINGS
TestPriorityCacheManager = PriorityMachine.TestCase
TestPriorityCacheManager.settings = SETTINGS
TestWindowedCacheManager = WindowedMachine.TestCase
TestWindowedCacheManager.settings = SETTINGS
TestAttentionOnlyCacheManager = AttentionOnlyMachine.TestCase
TestAttentionOnlyCacheManager.settings = SETTINGS


def test_a_request_preempted_in_a_step_leaves_no_save_in_its_plan():
    """`low` is planned first and its chunk reaches a boundary (a save is queued); then `high`
    needs a block and preempts it, and `high`'s save takes the slot `low`'s save was given.
    Were `low`'s save left in the plan, two slots would be copied into one, and the
    checkpoint of `high`'s prefix could hold `low`'s state (found by the machines above)."""
    scheduler = Scheduler(SchedulerConfig(
        num_blocks=5, block_size=4, max_num_seqs=2, max_num_batched_tokens=8,
        num_state_slots=6, state_checkpoint_interval=2, scheduling_policy="priority",
    ))  # fmt: skip
    low = Request("low", list(range(100, 116)), SamplingParams(max_tokens=4), priority=1)
    high = Request("high", list(range(200, 216)), SamplingParams(max_tokens=3), priority=0)
    scheduler.add_request(low)
    resolve_step(scheduler, scheduler.schedule(), {})  # low: tokens 0..8
    scheduler.add_request(high)
    resolve_step(scheduler, scheduler.schedule(), {})  # low: 8..12; high: 0..4
    out = scheduler.schedule()  # low: 12..16 (a save), then high: 4..8 preempts it
    assert scheduler.num_preemptions == 1 and [s.request_id for s in out.scheduled] == ["high"]
    [(source, target)] = out.state_plan.saves
    held = scheduler.group("states").slots["high"]
    assert source == held.live and [p.slot for p in held.pending_saves] == [target]
