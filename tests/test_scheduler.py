"""Scheduler with no model: token counts per step, chunking, preemption, stops."""

from __future__ import annotations

import subprocess
import sys

import pytest

from scheduler import Request, SamplingParams, Scheduler, SchedulerConfig


def make(num_blocks=64, block_size=4, budget=16, max_seqs=8, max_len=256) -> Scheduler:
    return Scheduler(SchedulerConfig(
        num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_seqs,
        max_num_batched_tokens=budget, max_model_len=max_len,
    ))


def req(rid: str, n: int, max_tokens: int = 4, **kw) -> Request:
    return Request(rid, list(range(10, 10 + n)), SamplingParams(max_tokens=max_tokens, **kw),
                   eos_token_ids=(2,))


def step(s: Scheduler, token: int = 7):
    out = s.schedule()
    sampled = {x.request_id: token for x in out.scheduled if x.samples}
    return out, s.update(out, sampled)


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
        assert s.pool.num_free_blocks + sum(len(r.block_ids) for r in s.running) == 6
        steps += 1
        assert steps < 100
    assert finished == {"r0", "r1", "r2"}
    assert preempted > 0


def test_preempted_request_recomputes_prompt_and_outputs():
    s = make(num_blocks=4, block_size=4, budget=64)
    s.add_request(req("old", 8, max_tokens=8))
    s.add_request(req("new", 8, max_tokens=8))
    step(s)  # both prefilled: 2 blocks each, pool full
    out, _ = step(s)  # "old" needs a third block: "new" is preempted
    assert counts(out) == {"old": 1}
    new = s.requests["new"]
    assert new.num_computed_tokens == 0 and new.block_ids == [] and s.waiting[0] is new
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
