"""What a cache group is: one kind of per-request cache with ids of its own, and the hooks the
scheduler calls on every group alike.

A request's KV blocks of every token are the anchor group (full_attention, or latent for
multi-head latent attention): a prefix hit is a run of those blocks, and a block's hash names
the prefix up to it. Every other group holds something beside them and answers for its part of
a hit of `n` blocks, of admission, of each step and of leaving:

    hit         what a hit of n blocks needs of the group, and whether memory or the tier has it
    can_admit   whether its pool can back a request admitted over n cached blocks
    admit       take what the hit found, or fresh ids for what the tier loads
    cut         end a chunk where the group must see a boundary (a state checkpoint)
    reserve     ids for the step's new tokens (after freeing what no row sees again)
    scheduled   the step is composed: queue the group's work for it (a checkpoint copy)
    resolved    the step ran: cache what it filled under its block hashes
    release     the request leaves the batch (finished or preempted)

and, for a step that verifies drafts, whether the group can back them (`before_drafts`), how
far they may reach (`draft_room`) and what it does once they are judged (`drafts_resolved`).
The defaults are those of a group that holds nothing for that hook. Adding a kind is one
subclass and a line in `scheduler.cache_groups.groups_for`. Single-threaded (the scheduler).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from scheduler.kv_connector import TierShare

if TYPE_CHECKING:
    from scheduler.output import CacheKind, SchedulerOutput
    from scheduler.prefix_hash import BlockHash
    from scheduler.request import Request


class CacheGroup:
    kind: CacheKind  # its name in the tier's plans and in ScheduledRequest.group_ids

    # -- prefix hits and admission ------------------------------------------------------------

    def hit(self, request: Request, num_blocks: int) -> TierShare | int:
        """What a prefix hit of the request's first `num_blocks` blocks needs of this group
        that memory lacks and the tier holds (empty: memory has all it needs), or, when
        neither has it, the largest count below `num_blocks` worth trying. Changes nothing."""
        return TierShare()

    def can_admit(self, request: Request, num_blocks: int, num_new: int) -> bool:
        """Whether the group can back a request admitted over `num_blocks` cached blocks and
        its first `num_new` tokens. Changes nothing."""
        return True

    def admit(self, request: Request, num_blocks: int, share: TierShare) -> None:
        """Start the request's part after `num_blocks` cached blocks: what memory holds of
        the hit, and fresh ids that the tier's `share` (from `hit`) is loaded into."""

    # -- each step -----------------------------------------------------------------------------

    def cut(self, request: Request, start: int, num_new: int) -> int:
        """The tokens of a chunk from `start` the group lets one step compute."""
        return num_new

    def reserve(self, request: Request, num_new: int) -> bool:
        """Ids for the request's next `num_new` tokens; False (none given) if the pool is
        short."""
        return True

    def ids(self, request: Request) -> list[int]:
        """The request's ids in the group, as the runner reads them."""
        return []

    def scheduled(self, request: Request, num_new: int) -> None:
        """The request computes `num_new` tokens in the step being composed."""

    def resolved(self, request: Request, num_hashed_blocks: int, num_computed: int) -> None:
        """A step ran: the request's first `num_computed` tokens are computed and known, its
        blocks from `num_hashed_blocks` up to the last full one newly hashed."""

    def release(self, request: Request) -> None:
        """The request leaves the running batch: whatever it holds goes back."""

    def block_evicted(self, block_hash: BlockHash) -> None:
        """The anchor's cached block of `block_hash` is being reused: a hit can no longer
        reach past it."""

    # -- drafts --------------------------------------------------------------------------------

    def holds_back(self, request: Request) -> bool:
        """Whether the request must not be scheduled until its drafts in flight are judged."""
        return False

    def draft_room(self, start: int) -> int:
        """The most drafts a step from `start` may verify."""
        return sys.maxsize

    def before_drafts(self, request: Request) -> bool:
        """Prepare for a step verifying the request's drafts; False (nothing changed) if the
        group cannot back them."""
        return True

    def drafts_resolved(self, request: Request, rejected: bool) -> bool:
        """The drafts' step resolved; whether the group went back to before them, so the
        request recomputes from that step's start."""
        return False

    # -- the step's plan and the group's contents ----------------------------------------------

    def take_plan(self, out: SchedulerOutput) -> None:
        """Hand the step the group's queued work for the runner."""

    def cached(self) -> list[tuple[int, BlockHash]]:
        """Every id holding cached data, with its hash (saved to the tier at shutdown)."""
        return []

    def usage(self) -> tuple[int, int]:
        """(ids in use, ids in all)."""
        return 0, 0
