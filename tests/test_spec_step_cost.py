"""`never_slower` speculation without a model: the step cost learned from measured steps, the
plan that drafts only what pays for its rows, and the scheduler driving both from step times."""

from __future__ import annotations

import pytest
from scheduler_helpers import resolve_step

from scheduler import Request, SamplingParams, Scheduler, SchedulerConfig
from scheduler.spec_decode.config import SpeculativeConfig
from scheduler.spec_decode.draft_plan import BesidePrefill, DraftOffer, plan_drafts
from scheduler.spec_decode.step_cost import EXACT_ROWS, StepCost, bucket_of


def cost_of(points: dict[int, float]) -> StepCost:
    cost = StepCost()
    for rows, seconds in points.items():
        cost.observe(rows, seconds)
    return cost


def test_buckets_are_exact_then_geometric_and_ordered():
    assert [bucket_of(r) for r in range(1, EXACT_ROWS + 1)] == list(range(1, EXACT_ROWS + 1))
    buckets = [bucket_of(r) for r in range(1, 2048)]
    assert buckets == sorted(buckets)
    assert bucket_of(100) == bucket_of(104) != bucket_of(128)  # ~12% wide past 16


def test_nothing_is_predicted_below_what_was_measured():
    assert StepCost().seconds(1) is None
    cost = cost_of({4: 0.04})
    assert cost.seconds(3) is None
    assert cost.seconds(4) == pytest.approx(0.04)
    assert cost.seconds(9) == pytest.approx(0.04)  # one point: flat past it, to be tried


def test_between_points_it_interpolates_and_past_them_it_follows_the_last_slope():
    cost = cost_of({1: 0.030, 5: 0.040, 16: 0.066})
    assert cost.seconds(3) == pytest.approx(0.035)
    assert cost.seconds(10) == pytest.approx(0.040 + 0.026 * 5 / 11)
    assert cost.seconds(27) == pytest.approx(0.066 + 0.026 * 11 / 11)


def test_a_bucket_follows_its_recent_steps_and_ignores_one_slow_step():
    cost = StepCost(window=5)
    for seconds in (0.10, 0.10, 0.10, 0.05, 0.05, 0.05):  # the context grew shorter
        cost.observe(2, seconds)
    assert cost.seconds(2) == pytest.approx(0.05)
    cost.observe(2, 5.0)  # a compile, or other work on the machine
    assert cost.seconds(2) == pytest.approx(0.05)


def test_a_bucket_is_priced_at_its_fastest_recent_step():
    cost = cost_of({})
    for seconds in (0.06, 0.04, 0.05):
        cost.observe(3, seconds)
    assert cost.seconds(3) == pytest.approx(0.04)


def test_rows_priced_in_a_busy_moment_are_forgotten_and_drafted_again():
    """A verification priced slow once would never run again (the plan avoids it), so a
    bucket not measured for `max_age` steps is forgotten and its rows get tried again."""
    decode, verify = StepCost(max_age=16), StepCost(max_age=16)
    verify.observe(2, 0.031, step=0)
    verify.observe(9, 0.5, step=1)  # another job held the cores in that step
    for step in range(2, 40):
        decode.observe(1, 0.03, step)
        if step % 8 == 0:
            verify.observe(2, 0.031, step)  # one-draft steps still run now and then

    def planned() -> list[int]:
        return plan_drafts(decode, 1, [DraftOffer(8, 0.9)], budget=8, verify=verify)

    assert planned() == [1]
    for cost in (decode, verify):
        cost.expire(39)
    assert verify.seconds(9) < 0.5
    assert planned() == [8]


def test_one_slow_undrafted_step_does_not_price_its_rows():
    """A decode-only bucket priced by one slow step (a compile) would make every draft of
    those rows look cheap, and no undrafted step would run to correct it: it counts from its
    second step, by then at the faster one."""
    decode, verify = StepCost(min_steps=2), cost_of({17: 0.058, 24: 0.080})
    for rows, seconds in ((15, 0.053), (15, 0.053), (16, 1.03)):  # the first 16-row step
        decode.observe(rows, seconds)
    likely, unlikely = [DraftOffer(8, 0.95)] * 16, [DraftOffer(8, 0.7)] * 16
    assert plan_drafts(decode, 16, likely, 64, verify=verify) == [0] * 16  # unpriced
    decode.observe(16, 0.056)
    assert decode.seconds(16) == pytest.approx(0.056)
    # Priced at its faster step: drafts pay only where they are likely.
    assert plan_drafts(decode, 16, unlikely, 64, verify=verify) == [0] * 16
    assert sum(plan_drafts(decode, 16, likely, 64, verify=verify)) > 0


def test_more_rows_never_predict_a_cheaper_step_and_slow_outliers_give_way():
    cost = cost_of({1: 0.05, 2: 0.03, 4: 0.06})  # a slow 1-row step measured once
    assert cost.seconds(1) == pytest.approx(0.03)
    assert cost.seconds(1) <= cost.seconds(2) <= cost.seconds(3) <= cost.seconds(4)


def test_bad_measurements_are_refused():
    with pytest.raises(ValueError, match="at least 1 row"):
        StepCost().observe(0, 0.1)
    with pytest.raises(ValueError, match="at least 1 row"):
        StepCost().observe(3, 0.0)


def flat(up_to: int, seconds: float = 0.03) -> StepCost:
    """A memory-bound machine: a step costs the same whatever its rows."""
    return cost_of({1: seconds, up_to: seconds})


def linear(per_row: float = 0.002) -> StepCost:
    """A saturated machine: a step costs in proportion to its rows."""
    return cost_of({1: per_row, 64: 64 * per_row})


def test_a_memory_bound_step_drafts_everything_offered():
    assert plan_drafts(flat(64), 2, [DraftOffer(8, 0.5), DraftOffer(3, 0.9)], 100) == [8, 3]


def test_the_budget_caps_the_drafts_and_goes_to_the_likeliest_first():
    lengths = plan_drafts(flat(64), 2, [DraftOffer(8, 0.3), DraftOffer(8, 0.9)], 4)
    assert lengths == [0, 4]


@pytest.mark.parametrize("rate", [0.5, 0.99, 1.0])
def test_a_saturated_step_drafts_nothing(rate):
    assert plan_drafts(linear(), 16, [DraftOffer(8, rate)] * 16, 1000) == [0] * 16


def test_an_unmeasured_step_drafts_nothing_so_it_gets_measured():
    assert plan_drafts(flat(64), 0, [DraftOffer(8, 0.9)], 100) == [0]
    assert plan_drafts(cost_of({4: 0.03, 64: 0.03}), 2, [DraftOffer(8, 0.9)] * 2, 100) == [0, 0]
    assert plan_drafts(flat(8), 9, [DraftOffer(8, 0.9)] * 9, 100) == [0] * 9  # above them
    assert plan_drafts(flat(8), 5, [DraftOffer(8, 0.9)] * 5, 100) == [8] * 5  # between


def test_where_rows_cost_something_only_likely_drafts_pay():
    # The CPU's shape (docs/benchmarks.md): one draft costs a quarter of a step, five ~1.5x.
    cost = cost_of({1: 0.110, 2: 0.135, 6: 0.165})
    assert plan_drafts(cost, 1, [DraftOffer(5, 0.9)], 100) == [5]
    assert plan_drafts(cost, 1, [DraftOffer(5, 0.2)], 100) == [0]
    # Two requests: the likely one drafts; the unlikely one's rows would not pay.
    cost = cost_of({2: 0.10, 12: 0.13})
    assert plan_drafts(cost, 2, [DraftOffer(5, 0.95), DraftOffer(5, 0.05)], 100) == [5, 0]


LOOP = [5, 6, 7, 8] * 4  # the lookup drafts 5 6 7 8 ... after it


def scheduler(num_requests: int, max_num_seqs: int | None = None) -> Scheduler:
    speculative = SpeculativeConfig(method="ngram", num_speculative_tokens=3,
                                    prompt_lookup_min=1, prompt_lookup_max=2, never_slower=True)
    s = Scheduler(SchedulerConfig(num_blocks=256, block_size=4,
                                  max_num_seqs=max_num_seqs or num_requests,
                                  max_num_batched_tokens=512, max_model_len=256,
                                  enable_prefix_caching=False, speculative=speculative))
    for i in range(num_requests):
        s.add_request(Request(f"r{i}", LOOP, SamplingParams(max_tokens=200), eos_token_ids=(2,)))
    return s


def drive(s: Scheduler, step_seconds, num_steps: int) -> list[int]:
    """Run steps whose drafts are all accepted, each timed by `step_seconds(rows)`; the drafts
    each step verified."""
    drafted = []
    for _ in range(num_steps):
        out = s.schedule()
        sampled = {}
        for item in out.scheduled:  # accept every draft, then follow the loop
            known = s.requests[item.request_id].all_token_ids
            sampled[item.request_id] = [*item.draft_token_ids, LOOP[(len(known)) % 4]]
        resolve_step(s, out, sampled)
        s.observe_step(out, step_seconds(sum(len(x.token_ids) for x in out.scheduled)))
        drafted.append(sum(len(x.draft_token_ids) for x in out.scheduled))
    return drafted


def test_the_scheduler_drafts_where_rows_are_free_and_reports_the_speedup():
    s = scheduler(2)
    drafted = drive(s, lambda rows: 0.03, 20)
    assert drafted[1] == drafted[2] == 0  # the first two decode steps price undrafted ones
    assert all(d == 6 for d in drafted[3:])
    stats = s.drafter.stats
    assert stats.by_method["ngram"].num_accepted_tokens == stats.num_accepted_tokens > 0
    assert stats.speedup_estimate == pytest.approx(4.0, rel=0.1)  # 4 tokens a step for 1


def test_the_scheduler_stops_drafting_once_it_measures_rows_as_costly():
    s = scheduler(8)
    drafted = drive(s, lambda rows: 0.002 * rows, 12)
    assert drafted[3] > 0  # tried once past what was measured
    assert drafted[-5:] == [0] * 5  # then learned that rows cost in proportion


def test_one_slow_verifying_step_does_not_price_drafts_out():
    """The first step verifying drafts read slow (other work on the machine, cold caches):
    priced by it alone, every draft of that many rows or fewer looks dear, and none runs to
    correct it. Its bucket counts from its second step, which runs at the machine's pace."""
    s = scheduler(4)
    verifying_steps = []

    def step_seconds(rows: int) -> float:
        if rows == 4 or rows == 4 * len(LOOP):  # decodes, the prompts' prefill
            return 0.028
        verifying_steps.append(rows)
        slow = 0.1 if len(verifying_steps) == 1 else 0.0
        return 0.028 + 0.002 * (rows - 4) + slow

    drafted = drive(s, step_seconds, 16)
    first = next(i for i, d in enumerate(drafted) if d)
    assert len(verifying_steps) > 2 and sum(d > 0 for d in drafted[first + 1:]) >= 10
    # Priced as one step alone would (min_steps=1), the same drafts stop after the outlier.
    alone = StepCost()
    alone.observe(4 + drafted[first], 0.028 + 0.002 * drafted[first] + 0.1)
    offers = [DraftOffer(3, 0.95)] * 4
    assert plan_drafts(s.drafter.cost, 4, offers, 12, verify=alone) == [0] * 4
    assert sum(plan_drafts(s.drafter.cost, 4, offers, 12, verify=s.drafter.verify_cost)) > 0


def test_a_step_inside_the_smallest_bucket_below_its_mean_is_covered_and_priced():
    """Buckets past EXACT_ROWS span several row counts: a step below the mean rows of the
    smallest measured bucket is still in it, so it is priced at that bucket's point (once a
    step it `covers` had no price, and planning its drafts raised a TypeError)."""
    cost = StepCost()
    cost.observe(42, 0.3)
    cost.observe(44, 0.3)
    assert bucket_of(40) == bucket_of(43) and cost.covers(40)
    assert cost.seconds(40) == 0.3
    # One point: flat past it, so drafts are tried once (and their step measured).
    assert plan_drafts(cost, 40, [DraftOffer(4, 0.9)], budget=4) == [4]
    assert cost.seconds(39) is None and not cost.covers(39)


def test_steps_with_drafts_are_priced_from_their_own_measurements():
    """A decode-only step of 64 rows runs one path; with drafts the step runs another, 25%
    slower here: once such steps are measured, 64 rows with likely drafts draft nothing,
    though the decode-only steps alone would have them pay."""
    decode = cost_of({48: 0.20, 64: 0.224, 96: 0.30})
    offers = [DraftOffer(2, 0.9)] * 8
    assert sum(plan_drafts(decode, 64, offers, budget=16)) > 0
    verify = cost_of({66: 0.277, 80: 0.31})
    assert plan_drafts(decode, 64, offers, budget=16, verify=verify) == [0] * 8
    # Below the fewest rows measured with drafts: on the line from the step's own price.
    assert plan_drafts(decode, 48, offers, budget=16, verify=verify) == [0] * 8
    # Before any step with drafts is measured, the decode-only price lets one be tried.
    assert sum(plan_drafts(decode, 64, offers, budget=16, verify=StepCost())) > 0


def best_rate_by_search(cost: StepCost, num_rows: int, offers: list[DraftOffer], budget: int,
                        verify: StepCost) -> float:
    """The planner's objective over every number of the likeliest positions, no shortcut."""
    from scheduler.spec_decode.draft_plan import _with_drafts
    gains = sorted((o.rate ** j for o in offers for j in range(1, o.num_available + 1)),
                   reverse=True)[:budget]
    base = cost.seconds(num_rows)
    rates = [(num_rows + sum(gains[:d])) / _with_drafts(cost, verify, num_rows, base,
                                                          num_rows + d)
             for d in range(len(gains) + 1)]
    return max(rates)


@pytest.mark.parametrize("verify_points", [{}, {20: 0.05, 60: 0.09}, {30: 0.02}])
def test_the_plan_stops_early_only_where_no_later_position_could_win(verify_points):
    """The plan stops once the positions left cannot beat the best rate even at the least
    time a larger step could take; it must find what trying every count finds (with a
    drafting path dearer than decoding, cheaper, and unmeasured)."""
    decode = cost_of({8: 0.03, 16: 0.035, 32: 0.05, 64: 0.1})
    verify = cost_of(verify_points)
    offers = [DraftOffer(8, rate) for rate in (0.95, 0.8, 0.6, 0.3, 0.1, 0.05, 0.9, 0.7)]
    lengths = plan_drafts(decode, 8, offers, 64, min_gain=0.0, verify=verify)
    rates = sorted((o.rate ** j for o in offers for j in range(1, o.num_available + 1)),
                   reverse=True)
    d = sum(lengths)
    planned = (8 + sum(rates[:d])) / _seconds_with(decode, verify, 8, d)
    assert planned == pytest.approx(best_rate_by_search(decode, 8, offers, 64, verify))


def _seconds_with(cost: StepCost, verify: StepCost, num_rows: int, drafts: int) -> float:
    from scheduler.spec_decode.draft_plan import _with_drafts
    return _with_drafts(cost, verify, num_rows, cost.seconds(num_rows), num_rows + drafts)


def test_beside_a_prefill_chunk_a_draft_pays_by_the_decode_token_it_saves():
    """A 256-row step with a chunk costs ~1.2 ms a row (0.3 s); a decode step of the step's
    4 requests 0.05 s, 12.5 ms a token: a position pays where its rate**j beats ~0.1, though
    the chunk's rows (the decode-only curve never saw them) would have it draft nothing."""
    decode = cost_of({2: 0.045, 4: 0.05})
    chunks = cost_of({200: 0.25, 256: 0.3})
    prefill = BesidePrefill(chunks, num_requests=4)
    offers = [DraftOffer(8, 0.7), DraftOffer(8, 0.05)]
    assert plan_drafts(decode, 259, offers, 16) == [0, 0]
    assert plan_drafts(decode, 259, offers, 16, prefill=prefill) == [6, 0]  # 0.7**6 = 0.12
    assert plan_drafts(decode, 259, offers, 3, prefill=prefill) == [3, 0]  # the budget
    # Unmeasured: a step of rows no chunk step had, or of fewer requests than any decode.
    assert plan_drafts(decode, 600, offers, 16, prefill=prefill) == [0, 0]
    assert plan_drafts(decode, 259, offers, 16, prefill=BesidePrefill(chunks, 1)) == [0, 0]
    # Where a chunk's row costs what a decode's token does, nothing pays.
    dear = BesidePrefill(cost_of({256: 256 * 0.0125}), num_requests=4)
    assert plan_drafts(decode, 256, offers, 16, prefill=dear) == [0, 0]


def test_the_scheduler_drafts_beside_a_prefill_chunk_once_such_steps_are_measured():
    s = scheduler(2, max_num_seqs=4)
    drive(s, lambda rows: 0.03 + 0.001 * rows, 4)  # decode steps measured
    late = [Request(f"late{i}", LOOP * 8, SamplingParams(max_tokens=200), eos_token_ids=(2,))
            for i in range(2)]
    drafted_beside_chunks = []
    for request in late:
        s.add_request(request)
        out = s.schedule()
        assert any(len(x.token_ids) > 100 for x in out.scheduled)  # the late prompt's chunk
        drafted_beside_chunks.append(sum(len(x.draft_token_ids) for x in out.scheduled))
        sampled = {x.request_id: [*x.draft_token_ids, LOOP[len(
            s.requests[x.request_id].all_token_ids) % 4]] for x in out.scheduled if x.samples}
        resolve_step(s, out, sampled)
        s.observe_step(out, 0.03 + 0.001 * sum(len(x.token_ids) for x in out.scheduled))
    # The first such step is measured; in the next (4 requests, ~1.2 ms a row, ~8 ms a
    # decode's token) all three decodes draft their 3 tokens, the new one's at its prior 0.6.
    assert drafted_beside_chunks == [0, 9]


def test_lookups_run_only_for_requests_the_plan_could_take():
    """Where rows cost in proportion no request can draft: none is looked up (the lookups
    were most of a 64-request step's host time)."""
    s = scheduler(8)
    looked_up = []
    propose = s.drafter.propose
    s.drafter.propose = lambda request, k: looked_up.append(request.request_id) or propose(
        request, k)
    drive(s, lambda rows: 0.002 * rows, 12)
    looked_up.clear()
    drive(s, lambda rows: 0.002 * rows, 3)
    assert looked_up == []
