"""Slots of recurrent state (linear-attention layers' conv window + state), in plain ints.

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
from typing import TYPE_CHECKING

from scheduler.block_pool import BlockPool
from scheduler.output import StatePlan
from scheduler.prefix_hash import BlockHash
from scheduler.request import PendingSave

if TYPE_CHECKING:
    from scheduler.kv_connector import KVConnectorScheduler
    from scheduler.request import Request


class StateCache:
    """Live slots for running requests and checkpoints for prefix hits, over one id pool.

    Invariant: every id is live (held by one request), pending (being written by a step in
    flight) or free; a free id may keep a checkpoint's hash. Single-threaded (the scheduler).
    """

    def __init__(self, num_slots: int, block_size: int, interval: int | None,
                 tier: KVConnectorScheduler | None = None) -> None:
        """`interval`: blocks between the checkpoints of a long prompt; None saves none (no
        prefix caching). `tier`: the KV tier past memory, which keeps dropped checkpoints."""
        if interval is not None and interval < 1:
            raise ValueError(f"the state checkpoint interval must be at least 1, got {interval}")
        self.tier = tier
        self.pool = BlockPool(num_slots, on_evict=self._evicted if tier else None)
        self.block_size, self.interval = block_size, interval
        self.plan = StatePlan()

    @property
    def num_free_slots(self) -> int:
        return self.pool.num_free_blocks

    def has(self, block_hash: BlockHash) -> bool:
        return self.pool.lookup(block_hash) is not None

    # -- a request's slots ---------------------------------------------------------------------

    def start(self, request: Request, num_cached_blocks: int, from_tier: bool = False) -> None:
        """Give an admitted request a live slot, restored before the step from the checkpoint
        at the end of its `num_cached_blocks` cached blocks, which the prefix cache matched in
        the pool or, `from_tier`, in the tier: that one is loaded into a checkpoint slot of
        its own first, so requests admitted after it find it in the pool. The caller checked
        that a slot is free."""
        block_hash = request.block_hashes[num_cached_blocks - 1] if num_cached_blocks else None
        if from_tier:
            self._load(block_hash)
        source = None if block_hash is None else self.pool.lookup(block_hash)
        if source is not None:
            self.pool.take_cached([source])  # most recently used: allocated last
            self.pool.free([source])
        slots = self.pool.allocate(1)
        assert slots is not None, "the caller checked num_free_slots"
        request.state_slot = slots[0]
        if source is not None:  # the slot may be the checkpoint's own: copying is then a no-op
            self.plan.restores.append((source, slots[0]))
        elif from_tier:  # no slot was free for the checkpoint: straight into the live one
            self.tier.load("states", [(slots[0], block_hash)])

    def _load(self, block_hash: BlockHash) -> None:
        slots = self.pool.allocate(1)
        if slots is not None:
            self.pool.cache(slots[0], block_hash)
            self.pool.free(slots)
            self.tier.load("states", [(slots[0], block_hash)])

    def cut(self, request: Request, start: int, num_new: int) -> int:
        """The tokens of a chunk from `start` cut to end at the first prompt checkpoint
        inside it."""
        if self.interval is None:
            return num_new
        boundary = next_prompt_checkpoint(start, start + num_new, request.num_prompt_tokens,
                                          self.block_size, self.interval)  # fmt: skip
        return num_new if boundary is None else boundary - start

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
            self.plan.saves.append((request.state_slot, slots[0]))
            request.pending_saves.append(PendingSave(slots[0], end, kind == "decode"))

    def resolved(self, request: Request, num_computed: int) -> None:
        """Commit the request's checkpoints up to `num_computed` tokens, whose step has run
        (their block hashes are known). A checkpoint an equal one beat is freed; a new decode
        checkpoint replaces the request's previous one."""
        while request.pending_saves and request.pending_saves[0].boundary <= num_computed:
            pending = request.pending_saves.pop(0)
            block_hash = request.block_hashes[pending.boundary // self.block_size - 1]
            cached = self.pool.cache(pending.slot, block_hash)
            self.pool.free([pending.slot])
            if cached and pending.decode:
                if request.decode_checkpoint is not None:
                    self.pool.forget(request.decode_checkpoint)
                request.decode_checkpoint = block_hash

    def stop(self, request: Request) -> None:
        """The request leaves the running batch (finished or preempted): its live slot, its
        snapshot and the checkpoints still being written are free (a write in flight lands in
        a free slot, which whoever takes it next overwrites first). Copies the plan holds into
        its slots go from the plan: they may be taken again in the same step."""
        pending = {p.slot for p in request.pending_saves}
        self.plan.saves = [(s, target) for s, target in self.plan.saves if target not in pending]
        self.plan.restores = [(s, target) for s, target in self.plan.restores
                              if target not in (request.state_slot, request.state_snapshot)]
        slots = list(pending)
        for slot in (request.state_slot, request.state_snapshot):
            if slot is not None:
                slots.append(slot)
        self.pool.free(slots)
        request.state_slot, request.state_snapshot, request.pending_saves = None, None, []

    # -- drafts --------------------------------------------------------------------------------

    def draft_room(self, start: int) -> int:
        """The most drafts a step from `start` may verify without reaching a block boundary
        (where a checkpoint may be saved)."""
        if self.interval is None:
            return sys.maxsize  # no checkpoints: no bound
        into_block = (start + 1) % self.block_size
        return 0 if into_block == 0 else self.block_size - into_block - 1

    def snapshot(self, request: Request) -> bool:
        """Copy the live state into a slot of its own before the step that verifies the
        request's drafts; False (nothing changed) if no slot is free. The plan's copies run
        as one batch, reading before writing: a live slot this plan restores from a
        checkpoint is snapshotted from that checkpoint."""
        slots = self.pool.allocate(1)
        if slots is None:
            return False
        source = next((s for s, target in reversed(self.plan.restores)
                       if target == request.state_slot), request.state_slot)
        self.plan.restores.append((source, slots[0]))
        request.state_snapshot = slots[0]
        return True

    def settle(self, request: Request, rejected: bool) -> None:
        """The drafts' step resolved. After a rejection the snapshot becomes the live slot
        (the next step recomputes from there) and the state past the drafts is dropped;
        otherwise the snapshot is. No step in flight reads either: a request with drafts in
        flight is not scheduled behind them."""
        dropped = request.state_snapshot
        if rejected:
            dropped, request.state_slot = request.state_slot, request.state_snapshot
        self.pool.free([dropped])
        request.state_snapshot = None

    def forget(self, block_hash: BlockHash) -> None:
        """Drop the checkpoint of `block_hash`, if any: its block left the KV pool (for the
        tier, if there is one, as the checkpoint does)."""
        slot = self.pool.lookup(block_hash)
        if slot is None:
            return
        if self.tier is not None:
            self._evicted(slot, block_hash)
        self.pool.forget(block_hash)

    def _evicted(self, slot: int, block_hash: BlockHash) -> None:
        self.tier.evicted("states", slot, block_hash)

    def checkpoints(self) -> list[tuple[int, BlockHash]]:
        """Every checkpoint held: (slot, hash)."""
        return self.pool.cached_blocks()

    def take_plan(self) -> StatePlan:
        plan, self.plan = self.plan, StatePlan()
        return plan


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
