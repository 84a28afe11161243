"""Scheduler with no model: token counts per step, chunking, preemption, stops."""

from __future__ import annotations

import subprocess
import sys

import pytest
from scheduler_helpers import resolve_step

from scheduler import Request, SamplingParams, Scheduler, SchedulerConfig


def make(num_blocks=64, block_size=4, budget=16, max_seqs=8, max_len=256,
         caching=True) -> Scheduler:
    return Scheduler(SchedulerConfig(
        num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_seqs,
        max_num_batched_tokens=budget, max_model_len=max_len, enable_prefix_caching=caching,
    ))


def req(rid: str, n: int, max_tokens: int = 4, first: int = 10, priority: int = 0,
        **kw) -> Request:
    return Request(rid, list(range(first, first + n)),
                   SamplingParams(max_tokens=max_tokens, **kw), eos_token_ids=(2,),
                   priority=priority)


def step(s: Scheduler, token: int = 7):
    out = s.schedule()
    sampled = {x.request_id: token for x in out.scheduled if x.samples}
    return out, resolve_step(s, out, sampled)


def counts(out) -> dict[str, int]:
    return {x.request_id: len(x.token_ids) for x in out.scheduled}


def test_long_prompt_is_chunked_while_running_requests_decode():
    s = make(budget=8)
    s.add_request(req("short", 3, max_tokens=10))
    out, _ = step(s)
    assert counts(out) == {"short": 3}
    s.add_request(req("long", 20))
    out, _ = step(s)
    assert counts(out) == {"short": 1, "long": 7}  # the decode goes first
    assert [x.samples for x in out.scheduled] == [True, False]
    out, _ = step(s)
    assert counts(out) == {"short": 1, "long": 7}
    out, _ = step(s)
    assert counts(out) == {"short": 1, "long": 6}
    assert out.scheduled[1].samples and out.scheduled[1].start_position == 14


def test_max_num_seqs_limits_admission():
    s = make(max_seqs=2)
    for i in range(3):
        s.add_request(req(f"r{i}", 2))
    out, _ = step(s)
    assert set(counts(out)) == {"r0", "r1"}


def test_finished_request_frees_blocks_at_once():
    s = make(num_blocks=8)
    s.add_request(req("a", 5, max_tokens=2))
    step(s)
    assert s.pool.num_free_blocks == 6
    _, updates = step(s)
    assert updates[0].finish_reason == "length"
    assert s.pool.num_free_blocks == 8 and not s.has_unfinished_requests()


def test_eos_stops_unless_ignored():
    s = make()
    s.add_request(req("a", 3, max_tokens=5))
    s.add_request(req("b", 3, max_tokens=5, ignore_eos=True))
    _, updates = step(s, token=2)
    assert {u.request.request_id: u.finish_reason for u in updates} == {"a": "stop", "b": None}


def test_preempts_newest_when_pool_runs_out_and_everything_finishes():
    s = make(num_blocks=6, block_size=4, budget=64)
    for i in range(3):
        s.add_request(req(f"r{i}", 7, max_tokens=6))
    finished, preempted, steps = set(), 0, 0
    while s.has_unfinished_requests():
        out, updates = step(s)
        preempted += len(s.waiting) > 0 and any(r.output_token_ids for r in s.waiting)
        finished |= {u.request.request_id for u in updates if u.finish_reason}
        used = {b for r in s.running for b in r.block_ids}  # shared prefix blocks count once
        assert s.pool.num_free_blocks + len(used) == 6
        steps += 1
        assert steps < 100
    assert finished == {"r0", "r1", "r2"}
    assert preempted > 0


def test_preempted_request_recomputes_prompt_and_outputs():
    s = make(num_blocks=4, block_size=4, budget=64, caching=False)
    s.add_request(req("old", 8, max_tokens=8))
    s.add_request(req("new", 8, max_tokens=8))
    step(s)  # both prefilled: 2 blocks each, pool full
    out, _ = step(s)  # "old" needs a third block: "new" is preempted
    assert counts(out) == {"old": 1}
    new = s.requests["new"]
    assert new.num_computed_tokens == 0 and new.block_ids == [] and list(s.waiting) == [new]
    while s.requests.get("old"):
        step(s)
    out, _ = step(s)
    assert counts(out) == {"new": 9}  # prompt + its one output token, recomputed


def test_abort_frees_blocks_and_reports_finished_id():
    s = make(num_blocks=8)
    s.add_request(req("a", 9))
    step(s)
    s.finish_request("a", "abort")
    assert s.pool.num_free_blocks == 8
    out, _ = step(s)
    assert out.finished_ids == ["a"] and out.is_empty


def test_rejects_requests_that_can_never_fit():
    s = make(num_blocks=4, block_size=4, max_len=64)
    with pytest.raises(ValueError, match="context length is 64"):
        s.add_request(req("a", 64))
    with pytest.raises(ValueError, match="kv-cache-memory"):
        s.add_request(req("b", 10, max_tokens=20))


def test_scheduler_does_not_import_mlx():
    code = "import sys, scheduler; print('mlx' in sys.modules or 'mlx.core' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "False"


# -- prefix caching -----------------------------------------------------------------------------


def run_to_end(s: Scheduler, token: int = 7) -> None:
    while s.has_unfinished_requests():
        step(s, token)


def test_shared_prefix_of_a_finished_request_is_not_recomputed():
    s = make(block_size=4, budget=64)
    s.add_request(req("a", 14, max_tokens=1))
    run_to_end(s)
    b = Request("b", list(range(10, 22)) + [99, 98, 97], SamplingParams(max_tokens=2))
    s.add_request(b)  # shares 12 tokens = 3 blocks with "a", then differs
    out, _ = step(s)
    assert b.num_computed_tokens == 15 and b.num_cached_tokens == 12
    assert counts(out) == {"b": 3} and out.scheduled[0].start_position == 12
    assert out.scheduled[0].token_ids == [99, 98, 97] and out.scheduled[0].samples
    assert s.prefix_cache.stats.hit_tokens == 12
    assert s.prefix_cache.stats.queried_tokens == 14 + 15


def test_fully_cached_prompt_still_computes_its_last_token():
    s = make(block_size=4, budget=64)
    s.add_request(req("a", 12, max_tokens=1))
    run_to_end(s)
    s.add_request(req("b", 12, max_tokens=1))  # all 3 blocks cached; only 2 may be reused
    out, _ = step(s)
    assert counts(out) == {"b": 4} and out.scheduled[0].start_position == 8
    s.add_request(req("c", 13, max_tokens=1))  # 3 blocks + 1 token: all 3 reused
    out, _ = step(s)
    assert counts(out) == {"c": 1} and out.scheduled[0].start_position == 12


def test_hit_on_blocks_of_a_running_request_shares_them():
    s = make(block_size=4, budget=64)
    s.add_request(req("a", 10, max_tokens=20))
    step(s)  # "a" has computed 10 tokens: blocks 0 and 1 are full and cached
    a = s.requests["a"]
    s.add_request(req("b", 9, max_tokens=20))
    out, _ = step(s)
    b = s.requests["b"]
    assert counts(out) == {"a": 1, "b": 1}
    assert b.block_ids[:2] == a.block_ids[:2] and b.block_ids[2] not in a.block_ids
    assert [s.pool.refcount(x) for x in a.block_ids[:2]] == [2, 2]
    s.finish_request("a", "abort")
    assert [s.pool.refcount(x) for x in b.block_ids[:2]] == [1, 1]
    run_to_end(s)
    assert s.pool.num_free_blocks == 64


def test_least_recently_freed_prefix_is_evicted_first():
    s = make(num_blocks=6, block_size=4, budget=64)
    s.add_request(req("old", 8, max_tokens=1, first=10))
    run_to_end(s)
    s.add_request(req("new", 8, max_tokens=1, first=50))
    run_to_end(s)  # 4 cached blocks, freed oldest first: old's, then new's
    s.add_request(req("filler", 15, max_tokens=1, first=90))  # takes 4 blocks: 2 unhashed first
    step(s)
    s.finish_request("filler", "abort")
    s.add_request(req("new2", 9, max_tokens=1, first=50))
    s.add_request(req("old2", 9, max_tokens=1, first=10))
    out, _ = step(s)
    assert counts(out) == {"new2": 1, "old2": 9}  # old's prefix was evicted, new's kept


def test_preempted_request_resumes_after_its_cached_prefix():
    s = make(num_blocks=5, block_size=4, budget=64)
    s.add_request(req("old", 8, max_tokens=4))
    s.add_request(req("new", 8, max_tokens=8, first=50))
    step(s)  # both prefilled: 2 full blocks each, cached; 1 block left
    out, _ = step(s)  # "old" takes it; "new" finds no third block and is preempted
    assert counts(out) == {"old": 1}
    while s.requests.get("old"):
        step(s)
    out, _ = step(s)
    assert counts(out) == {"new": 1}  # prompt blocks still cached: only its output token
    assert s.requests["new"].num_cached_tokens == 0  # usage counts the first admission
    stats = s.prefix_cache.stats  # as vLLM counts: the readmission's own blocks are no hits
    assert (stats.queried_tokens, stats.hit_tokens) == (8 + 8, 0)



def test_a_request_preempted_during_prefill_reports_none_of_its_own_blocks_as_cached():
    s = make(num_blocks=5, block_size=4, budget=8)
    s.add_request(req("old", 8, max_tokens=8))
    s.add_request(req("new", 12, max_tokens=2, first=50))
    step(s)
    out, _ = step(s)  # "new" prefills 7 tokens: one full block, cached
    assert counts(out) == {"old": 1, "new": 7}
    out, _ = step(s)  # no block for "new"'s next chunk: preempted before any output
    assert counts(out) == {"old": 1} and s.requests["new"].num_preemptions == 1
    while "new" not in counts(out):
        out, _ = step(s)
    assert counts(out) == {"new": 8}  # resumed after its own cached block
    new = s.requests["new"]
    assert new.num_cached_tokens == 0  # usage: nothing was cached when it first came
    assert s.prefix_cache.stats.hit_tokens == 0

# -- scheduling policy --------------------------------------------------------------------------


def make_with(policy: str, **kw) -> Scheduler:
    defaults = dict(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
                    max_model_len=256)
    return Scheduler(SchedulerConfig(scheduling_policy=policy, **{**defaults, **kw}))


def test_priority_policy_admits_lower_priority_values_first_then_by_arrival():
    s = make_with("priority", max_num_seqs=2)
    for rid, priority in [("a", 2), ("b", 0), ("c", 1), ("d", 0)]:
        s.add_request(req(rid, 4, max_tokens=1, priority=priority))
    assert [x.request_id for x in step(s)[0].scheduled] == ["b", "d"]
    assert [x.request_id for x in step(s)[0].scheduled] == ["c", "a"]


def test_fcfs_refuses_a_priority_and_names_the_flag():
    s = make_with("fcfs")
    with pytest.raises(ValueError, match="--scheduling-policy priority"):
        s.add_request(req("a", 4, priority=3))
    s.add_request(req("b", 4, priority=0))
    assert counts(step(s)[0]) == {"b": 4}


@pytest.mark.parametrize(
    ("policy", "priorities", "victim"),
    [
        ("fcfs", {"lazy": 0, "mid": 0, "urgent": 0}, "urgent"),  # the newest
        ("priority", {"lazy": 5, "mid": 1, "urgent": 0}, "lazy"),  # the lowest priority
    ],
)
def test_preemption_victim_follows_the_policy(policy, priorities, victim):
    s = make_with(policy, num_blocks=6, enable_prefix_caching=False)
    for rid, priority in priorities.items():  # arrival order: lazy, mid, urgent
        s.add_request(req(rid, 8, max_tokens=4, priority=priority))
    step(s)  # all three prefilled: 2 blocks each, the pool is full
    out, _ = step(s)  # the first two to decode need a third block each
    assert set(counts(out)) == set(priorities) - {victim}
    assert [r.request_id for r in s.waiting] == [victim]
    run_to_end(s)
    assert s.pool.num_free_blocks == 6


def test_priority_victim_already_scheduled_this_step_is_taken_back():
    s = make_with("priority", num_blocks=5, enable_prefix_caching=False)
    s.add_request(req("lazy", 6, max_tokens=10, priority=5))
    step(s)  # lazy: 2 blocks
    s.add_request(req("urgent", 12, max_tokens=8, priority=0))
    step(s)  # urgent: 3 blocks; the pool is full
    out, _ = step(s)  # lazy decodes first, then urgent needs a fourth block: lazy gives way
    assert counts(out) == {"urgent": 1}
    lazy = s.requests["lazy"]
    assert lazy.block_ids == [] and lazy.num_computed_tokens == 0 and lazy.num_output_tokens == 2
    run_to_end(s)
    assert s.pool.num_free_blocks == 5


def test_no_request_is_admitted_in_a_step_that_preempts():
    s = make_with("fcfs", num_blocks=4, enable_prefix_caching=False)
    s.add_request(req("a", 8, max_tokens=8))
    s.add_request(req("b", 4, max_tokens=8, first=50))
    step(s)  # a: 2 blocks, b: 1 block
    s.add_request(req("c", 2, max_tokens=1, first=90))
    out, _ = step(s)  # a takes the last block; b needs one and is preempted
    assert counts(out) == {"a": 1}
    assert [r.request_id for r in s.waiting] == ["b", "c"]
    run_to_end(s)


# -- concurrent identical prefixes --------------------------------------------------------------


def test_identical_prompts_arriving_together_compute_the_prefix_once():
    s = make(block_size=4, budget=64)
    s.add_request(req("a", 14, max_tokens=4))
    s.add_request(req("b", 14, max_tokens=4))
    out, _ = step(s)
    assert counts(out) == {"a": 14}  # b waits for a's three full blocks
    out, _ = step(s)
    a, b = s.requests["a"], s.requests["b"]
    assert counts(out) == {"a": 1, "b": 2} and out.scheduled[1].start_position == 12
    assert b.block_ids[:3] == a.block_ids[:3] and b.num_cached_tokens == 12
    assert s.prefix_cache.stats.hit_tokens == 12
    assert s.prefix_cache.stats.queried_tokens == 14 + 14


def test_identical_prompts_are_both_computed_without_prefix_caching():
    s = make(block_size=4, budget=64, caching=False)
    s.add_request(req("a", 14))
    s.add_request(req("b", 14))
    assert counts(step(s)[0]) == {"a": 14, "b": 14}


def test_waiter_shares_the_blocks_of_a_chunked_prefill_as_they_fill():
    s = make(block_size=4, budget=10)
    s.add_request(req("a", 18, max_tokens=4))
    step(s)  # a: 10 tokens, blocks 0-1 cached
    s.add_request(req("b", 18, max_tokens=4))
    out, _ = step(s)  # a's last 8 tokens; b could take blocks 0-1 but a is filling block 2
    assert counts(out) == {"a": 8}
    out, _ = step(s)
    assert counts(out) == {"a": 1, "b": 2}
    assert s.requests["b"].num_cached_tokens == 16


def test_request_waiting_for_blocks_does_not_hold_back_the_ones_behind_it():
    s = make(block_size=4, budget=64)
    s.add_request(req("a", 14))
    s.add_request(req("b", 14))
    s.add_request(req("c", 5, first=60))
    assert counts(step(s)[0]) == {"a": 14, "c": 5}


def test_waiter_computes_the_prefix_itself_when_the_computing_request_is_aborted():
    s = make(block_size=4, budget=64)
    s.add_request(req("a", 14))
    s.add_request(req("b", 14))
    out = s.schedule()
    assert counts(out) == {"a": 14}
    s.finish_request("a", "abort")  # while its step runs: its blocks are never cached
    resolve_step(s, out, {"a": 7})
    out, _ = step(s)
    assert counts(out) == {"b": 14} and s.requests["b"].num_cached_tokens == 0
    run_to_end(s)
    assert s.pool.num_free_blocks == 64


def test_abort_of_a_waiting_request_takes_it_out_of_the_queue():
    s = make(max_seqs=1)
    s.add_request(req("a", 4))
    s.add_request(req("b", 4, first=50))
    step(s)
    s.finish_request("b", "abort")
    out, _ = step(s)
    assert out.finished_ids == ["b"] and counts(out) == {"a": 1}
    assert len(s.waiting) == 0


# -- cache salts ---------------------------------------------------------------------------------


def salted(rid: str, salt: str | None, max_tokens: int = 1) -> Request:
    return Request(rid, list(range(10, 24)), SamplingParams(max_tokens=max_tokens),
                   cache_salt=salt)


def test_prompts_share_cached_blocks_only_under_the_same_salt():
    s = make(block_size=4, budget=64)
    requests = [salted("a", "tenant-a"), salted("b", "tenant-b"), salted("none", None),
                salted("a2", "tenant-a")]  # fmt: skip
    for request in requests:
        s.add_request(request)
        run_to_end(s)
    assert [r.num_cached_tokens for r in requests] == [0, 0, 0, 12]
    assert len(s.pool.cached_blocks()) == 3 * 3  # a, b and the unsalted prompt: 3 blocks each


def test_identical_prompts_with_different_salts_arriving_together_are_both_computed():
    s = make(block_size=4, budget=64)
    a, b = salted("a", "x", max_tokens=4), salted("b", "y", max_tokens=4)
    s.add_request(a)
    s.add_request(b)
    out, _ = step(s)
    assert counts(out) == {"a": 14, "b": 14}  # neither waits for the other's blocks
    assert not set(a.block_ids) & set(b.block_ids)
    assert not set(a.block_hashes) & set(b.block_hashes)


def test_a_salted_block_loaded_back_from_the_store_hits_only_its_salt():
    from test_scheduler_block_store import Tier, loads

    tier = Tier()
    tier.run(salted("a", "x"))
    tier.evict_everything()
    assert len(tier.store.blocks) >= 3
    assert loads(tier.run(salted("other", "y"))) == []
    assert loads(tier.run(salted("unsalted", None))) == []
    assert len(loads(tier.run(salted("again", "x")))) == 3


def test_whole_prompts_are_never_split_and_wait_for_a_step_with_room():
    from scheduler.pooling_params import PoolingParams

    s = Scheduler(SchedulerConfig(num_blocks=64, block_size=4, max_num_batched_tokens=16,
                                  max_model_len=16, enable_prefix_caching=False,
                                  whole_prompts=True))
    for rid, n in (("a", 10), ("b", 10), ("c", 5)):
        s.add_request(Request(rid, list(range(10, 10 + n)), SamplingParams(max_tokens=1),
                              eos_token_ids=(2,), pooling=PoolingParams("cls")))
    out, updates = step(s)
    assert counts(out) == {"a": 10}  # b does not fit the 6 tokens left; nothing jumps it
    assert [u.finish_reason for u in updates] == ["stop"]
    out, _ = step(s)
    assert counts(out) == {"b": 10, "c": 5}
    assert all(x.start_position == 0 and x.pools for x in out.scheduled)
    with pytest.raises(ValueError, match="whole prompts need a token budget"):
        SchedulerConfig(num_blocks=8, max_num_batched_tokens=8, max_model_len=16,
                        whole_prompts=True)
