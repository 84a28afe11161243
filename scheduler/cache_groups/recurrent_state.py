"""The recurrent-state cache group: slots of linear-attention layers' conv window + state, in
plain ints.

A hybrid model's request carries a fixed-size state besides its KV blocks. Each state slot
(the runner holds the tensors) is either

    live        one running request's state, advanced by every step it is scheduled in
    checkpoint  a copy of some request's state at a block boundary, keyed by the hash of the
                block that ends there, so a later prompt with that prefix resumes from it

The slot ids live in a BlockPool of their own: a live slot is a held id, a checkpoint a free
id that keeps its hash (so the least recently used is reused first). A checkpoint is saved in
the step that brings its request to the boundary and committed when that step resolves.

A step that verifies drafts advances the live state over all of them. Its request first
copies the state into a snapshot slot; if drafts are rejected, the snapshot becomes its live
slot and the request recomputes from its last known token (the accepted drafts with it). Recomputing
costs those few rows in the next step; keeping a state per draft position would cost a state
(megabytes) per position and a kernel that writes them. A drafting step never reaches a block
boundary, so a checkpoint never holds a rejected draft.

Which boundaries are saved (`checkpoint_at`): the last one a re-sent prompt can hit (the end
of its last full block before its final token), every `interval` blocks of a prompt (shared
prefixes such as an agent's system prompt), and while decoding each block boundary the
request reaches, keeping only the newest of those (the next turn of a conversation resumes
from its end).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from scheduler.block_pool import BlockPool
from scheduler.cache_groups.group import CacheGroup
from scheduler.kv_connector import TierShare
from scheduler.output import StatePlan
from scheduler.prefix_hash import BlockHash

if TYPE_CHECKING:
    from scheduler.kv_connector import KVConnectorScheduler
    from scheduler.output import SchedulerOutput
    from scheduler.request import Request


@dataclass
class PendingSave:
    """A checkpoint a step in flight is writing: its slot, the boundary (in tokens) and
    whether it is a decode checkpoint (superseded by the request's next one). Its block hash
    is known once the step resolves: the last token before the boundary may be pending."""

    slot: int
    boundary: int
    decode: bool


@dataclass
class RequestSlots:
    """What one running request holds: its live slot, its state before drafts a step
    verifies, checkpoints its steps in flight are writing, and its newest committed decode
    checkpoint (replaced by the next)."""

    live: int
    snapshot: int | None = None
    pending_saves: list[PendingSave] = field(default_factory=list)
    decode_checkpoint: BlockHash | None = None


class RecurrentStateGroup(CacheGroup):
    """Live slots for running requests and checkpoints for prefix hits, over one id pool.

    Invariant: every id is live (held by one request), pending (being written by a step in
    flight) or free; a free id may keep a checkpoint's hash.
    """

    kind = "states"

    def __init__(self, num_slots: int, block_size: int, interval: int | None,
                 connector: KVConnectorScheduler | None = None) -> None:
        """`interval`: blocks between the checkpoints of a long prompt; None saves none (no
        prefix caching). `connector`: the KV tier's, past memory, which keeps dropped
        checkpoints."""
        if interval is not None and interval < 1:
            raise ValueError(f"the state checkpoint interval must be at least 1, got {interval}")
        self.connector = connector
        self.pool = BlockPool(num_slots, on_evict=self._evicted if connector else None)
        self.block_size, self.interval = block_size, interval
        self.plan = StatePlan()
        self.slots: dict[str, RequestSlots] = {}  # running request id -> its slots

    @property
    def num_free_slots(self) -> int:
        return self.pool.num_free_blocks

    def has(self, block_hash: BlockHash) -> bool:
        return self.pool.lookup(block_hash) is not None

    # -- a request's slots ---------------------------------------------------------------------

    def hit(self, request: Request, num_blocks: int) -> TierShare | int:
        """The checkpoint at the hit's end: in a slot, or in the tier, or the hit is shorter."""
        if num_blocks == 0:
            return TierShare()
        checkpoint = request.block_hashes[num_blocks - 1]
        if self.has(checkpoint):
            return TierShare()
        where = self.connector.find(self.kind, checkpoint) if self.connector is not None else None
        if where is None:
            return num_blocks - 1
        return TierShare([checkpoint]) if where == "ready" else TierShare([], [checkpoint])

    def can_admit(self, request: Request, num_blocks: int, num_new: int) -> bool:
        return self.num_free_slots >= 1

    def admit(self, request: Request, num_blocks: int, share: TierShare) -> None:
        """Give an admitted request a live slot, restored before the step from the checkpoint
        at the end of its `num_blocks` cached blocks, which `hit` found in a slot or in the
        tier (`share`): that one is loaded into a checkpoint slot of its own first, so
        requests admitted after it find it in the pool."""
        block_hash = request.block_hashes[num_blocks - 1] if num_blocks else None
        from_tier = bool(share.ready)
        if from_tier:
            self._load(block_hash)
        source = None if block_hash is None else self.pool.lookup(block_hash)
        if source is not None:
            self.pool.take_cached([source])  # most recently used: allocated last
            self.pool.free([source])
        slots = self.pool.allocate(1)
        assert slots is not None, "can_admit checked num_free_slots"
        self.slots[request.request_id] = RequestSlots(slots[0])
        if source is not None:  # the slot may be the checkpoint's own: copying is then a no-op
            self.plan.restores.append((source, slots[0]))
        elif from_tier:  # no slot was free for the checkpoint: straight into the live one
            self.connector.load(self.kind, [(slots[0], block_hash)])

    def _load(self, block_hash: BlockHash) -> None:
        slots = self.pool.allocate(1)
        if slots is not None:
            self.pool.cache(slots[0], block_hash)
            self.pool.free(slots)
            self.connector.load(self.kind, [(slots[0], block_hash)])

    def cut(self, request: Request, start: int, num_new: int) -> int:
        """The tokens of a chunk from `start` cut to end at the first prompt checkpoint
        inside it."""
        if self.interval is None:
            return num_new
        boundary = next_prompt_checkpoint(start, start + num_new, request.num_prompt_tokens,
                                          self.block_size, self.interval)  # fmt: skip
        return num_new if boundary is None else boundary - start

    def ids(self, request: Request) -> list[int]:
        return [self.slots[request.request_id].live]

    def scheduled(self, request: Request, num_new: int) -> None:
        """Queue a checkpoint if the step brings the request to a boundary that saves one:
        a copy of its live slot after the step, committed when the step resolves. Skipped
        when every slot is live or pending (a checkpoint only saves work)."""
        end = request.num_computed_tokens + num_new
        if self.interval is None or end % self.block_size:
            return
        kind = checkpoint_at(end, request.num_prompt_tokens, self.block_size, self.interval)
        if kind is None:
            return
        slots = self.pool.allocate(1)
        if slots is not None:
            held = self.slots[request.request_id]
            self.plan.saves.append((held.live, slots[0]))
            held.pending_saves.append(PendingSave(slots[0], end, kind == "decode"))

    def resolved(self, request: Request, num_hashed_blocks: int, num_computed: int) -> None:
        """Commit the request's checkpoints up to `num_computed` tokens, whose step has run
        (their block hashes are known). A checkpoint an equal one beat is freed; a new decode
        checkpoint replaces the request's previous one."""
        held = self.slots.get(request.request_id)
        if held is None:
            return
        while held.pending_saves and held.pending_saves[0].boundary <= num_computed:
            pending = held.pending_saves.pop(0)
            block_hash = request.block_hashes[pending.boundary // self.block_size - 1]
            cached = self.pool.cache(pending.slot, block_hash)
            self.pool.free([pending.slot])
            if cached and pending.decode:
                if held.decode_checkpoint is not None:
                    self.pool.forget(held.decode_checkpoint)
                held.decode_checkpoint = block_hash

    def release(self, request: Request) -> None:
        """The request leaves the running batch (finished or preempted): its live slot, its
        snapshot and the checkpoints still being written are free (a write in flight lands in
        a free slot, which whoever takes it next overwrites first). Copies the plan holds into
        its slots go from the plan: they may be taken again in the same step."""
        held = self.slots.pop(request.request_id, None)
        if held is None:
            return
        pending = {p.slot for p in held.pending_saves}
        self.plan.saves = [(s, target) for s, target in self.plan.saves if target not in pending]
        self.plan.restores = [(s, target) for s, target in self.plan.restores
                              if target not in (held.live, held.snapshot)]
        slots = [*pending, held.live]
        if held.snapshot is not None:
            slots.append(held.snapshot)
        self.pool.free(slots)

    def block_evicted(self, block_hash: BlockHash) -> None:
        """Drop the checkpoint of `block_hash`, if any: its block left the KV pool (for the
        tier, if there is one, as the checkpoint does)."""
        slot = self.pool.lookup(block_hash)
        if slot is None:
            return
        if self.connector is not None:
            self._evicted(slot, block_hash)
        self.pool.forget(block_hash)

    def _evicted(self, slot: int, block_hash: BlockHash) -> None:
        self.connector.evicted(self.kind, slot, block_hash)

    # -- drafts --------------------------------------------------------------------------------

    def holds_back(self, request: Request) -> bool:
        """Its state may go back to before the drafts in flight."""
        held = self.slots.get(request.request_id)
        return held is not None and held.snapshot is not None

    def draft_room(self, start: int) -> int:
        """The most drafts a step from `start` may verify without reaching a block boundary
        (where a checkpoint may be saved)."""
        if self.interval is None:
            return sys.maxsize  # no checkpoints: no bound
        into_block = (start + 1) % self.block_size
        return 0 if into_block == 0 else self.block_size - into_block - 1

    def before_drafts(self, request: Request) -> bool:
        """Copy the live state into a slot of its own before the step that verifies the
        request's drafts; False (nothing changed) if no slot is free. The plan's copies run
        as one batch, reading before writing: a live slot this plan restores from a
        checkpoint is snapshotted from that checkpoint."""
        slots = self.pool.allocate(1)
        if slots is None:
            return False
        held = self.slots[request.request_id]
        source = next((s for s, target in reversed(self.plan.restores)
                       if target == held.live), held.live)
        self.plan.restores.append((source, slots[0]))
        held.snapshot = slots[0]
        return True

    def drafts_resolved(self, request: Request, rejected: bool) -> bool:
        """After a rejection the snapshot becomes the live slot (the next step recomputes
        from there) and the state past the drafts is dropped; otherwise the snapshot is. No
        step in flight reads either: a request with drafts in flight is not scheduled behind
        them."""
        held = self.slots.get(request.request_id)
        if held is None or held.snapshot is None:
            return False
        dropped = held.snapshot
        if rejected:
            dropped, held.live = held.live, held.snapshot
        self.pool.free([dropped])
        held.snapshot = None
        return True

    # -- the step's plan and the group's contents ----------------------------------------------

    def take_plan(self, out: SchedulerOutput) -> None:
        out.state_plan, self.plan = self.plan, StatePlan()

    def cached(self) -> list[tuple[int, BlockHash]]:
        """Every checkpoint held: (slot, hash)."""
        return self.pool.cached_blocks()

    def usage(self) -> tuple[int, int]:
        return self.pool.num_used_blocks, self.pool.num_blocks


def checkpoint_at(boundary: int, num_prompt_tokens: int, block_size: int,
                  interval: int) -> str | None:
    """Whether a request whose computed tokens reach `boundary` (a multiple of `block_size`)
    saves its state there: "prompt" (the last boundary a re-sent prompt can hit, or every
    `interval` blocks of the prompt), "decode" (past the prompt), else None."""
    if boundary == 0:
        return None
    if boundary >= num_prompt_tokens:
        return "decode"
    last_hit = (num_prompt_tokens - 1) // block_size * block_size
    if boundary == last_hit or (boundary // block_size) % interval == 0:
        return "prompt"
    return None


def next_prompt_checkpoint(start: int, end: int, num_prompt_tokens: int, block_size: int,
                           interval: int) -> int | None:
    """The first prompt checkpoint boundary strictly inside `(start, end)`: a chunk that
    spans one is cut there, so the state after the chunk is the boundary's."""
    every = interval * block_size
    last_hit = (num_prompt_tokens - 1) // block_size * block_size
    candidates = ((start // every + 1) * every, last_hit)
    inside = [b for b in candidates if start < b < min(end, num_prompt_tokens)]
    return min(inside, default=None)
