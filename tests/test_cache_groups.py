"""A cache kind is one class: a toy group, handed to the scheduler beside the KV blocks, takes
part in admission, each step's ids, preemption, leaving and prefix hits with nothing else
changed (scheduler.cache_groups.group)."""

from __future__ import annotations

import pytest
from scheduler_helpers import resolve_step

from scheduler import Request, SamplingParams, Scheduler, SchedulerConfig
from scheduler.cache_groups import CacheGroup
from scheduler.cache_groups.latent import LatentGroup
from scheduler.kv_connector import TierShare

BLOCK = 4


class Tickets(CacheGroup):
    """One ticket per running request out of a few; a hit reaches at most `max_hit` blocks
    (as a group that caches nothing past them would have it)."""

    kind = "tickets"

    def __init__(self, count: int, max_hit: int | None = None) -> None:
        self.free = list(range(count))
        self.held: dict[str, int] = {}
        self.max_hit = max_hit

    def hit(self, request: Request, num_blocks: int) -> TierShare | int:
        if self.max_hit is not None and num_blocks > self.max_hit:
            return self.max_hit
        return TierShare()

    def can_admit(self, request: Request, num_blocks: int, num_new: int) -> bool:
        return bool(self.free)

    def admit(self, request: Request, num_blocks: int, share: TierShare) -> None:
        self.held[request.request_id] = self.free.pop()

    def ids(self, request: Request) -> list[int]:
        return [self.held[request.request_id]]

    def release(self, request: Request) -> None:
        self.free.append(self.held.pop(request.request_id))

    def usage(self) -> tuple[int, int]:
        return len(self.held), len(self.held) + len(self.free)


def scheduler_with(group: CacheGroup | None, num_blocks: int = 64,
                   kv_kind: str = "blocks") -> Scheduler:
    config = SchedulerConfig(num_blocks=num_blocks, block_size=BLOCK, max_num_seqs=8,
                             max_num_batched_tokens=64, max_model_len=128, kv_kind=kv_kind)
    return Scheduler(config, groups=[] if group is None else [group])


def request(rid: str, prompt: list[int], max_tokens: int = 3) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))


def test_a_new_group_bounds_admission_and_hands_its_ids_to_each_step():
    tickets = Tickets(2)
    s = scheduler_with(tickets)
    for rid in "abc":
        s.add_request(request(rid, [1, 2, 3]))
    out = s.schedule()
    assert [item.request_id for item in out.scheduled] == ["a", "b"]  # two tickets
    assert {item.group_ids["tickets"][0] for item in out.scheduled} == {0, 1}
    assert all(item.group_ids["tickets"] == tickets.ids(s.requests[item.request_id])
               for item in out.scheduled)
    while s.has_unfinished_requests():
        out = s.schedule()
        assert len(out.scheduled) <= 2
        resolve_step(s, out, {item.request_id: 7 for item in out.scheduled if item.samples})
    assert tickets.held == {} and sorted(tickets.free) == [0, 1]  # every ticket came back
    assert s.pool.num_free_blocks == 64


def test_a_preempted_request_gives_its_ids_back():
    tickets = Tickets(4)
    s = scheduler_with(tickets, num_blocks=4)  # two requests of 5 tokens outgrow 4 blocks
    s.add_request(request("a", [1, 2, 3, 4, 5], max_tokens=6))
    s.add_request(request("b", [6, 7, 8, 9, 10], max_tokens=6))
    preempted_once = False
    while s.has_unfinished_requests():
        out = s.schedule()
        running = {r.request_id for r in s.running}
        assert set(tickets.held) == running
        preempted_once |= s.num_preemptions > 0
        resolve_step(s, out, {item.request_id: 7 for item in out.scheduled if item.samples})
    assert preempted_once and tickets.held == {} and len(tickets.free) == 4


def test_a_prefix_hit_reaches_only_as_far_as_every_group_has_its_part():
    prompt = list(range(20, 37))  # 17 tokens: 4 full blocks can hit
    for max_hit, cached in ((None, 4 * BLOCK), (2, 2 * BLOCK), (0, 0)):
        s = scheduler_with(Tickets(4, max_hit))
        s.add_request(request("first", prompt, max_tokens=1))
        while s.has_unfinished_requests():
            out = s.schedule()
            resolve_step(s, out, {item.request_id: 7 for item in out.scheduled if item.samples})
        again = request("again", prompt, max_tokens=1)
        s.add_request(again)
        out = s.schedule()
        assert out.scheduled[0].start_position == cached
        assert again.num_cached_tokens == cached


def test_a_latent_anchor_shares_blocks_as_full_attention_does_under_its_own_kind():
    """MLA's kind is the anchor's class and name; its blocks are hit and freed as full
    attention's."""
    prompt = list(range(20, 37))
    s = scheduler_with(None, kv_kind="latent")
    anchor = s.groups[0]
    assert isinstance(anchor, LatentGroup) and anchor.kind == "latent"
    requests = [request(rid, prompt, max_tokens=1) for rid in ("first", "again")]
    for r in requests:
        s.add_request(r)
        while s.has_unfinished_requests():
            out = s.schedule()
            resolve_step(s, out, {item.request_id: 7 for item in out.scheduled if item.samples})
    assert [r.num_cached_tokens for r in requests] == [0, 4 * BLOCK]
    assert s.cached().keys() == {"latent"} and len(s.cached()["latent"]) == 4
    assert s.pool.num_free_blocks == 64
    with pytest.raises(ValueError, match="kv_kind must be one of blocks, latent"):
        scheduler_with(None, kv_kind="keys")
