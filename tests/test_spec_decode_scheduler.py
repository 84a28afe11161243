"""Drafts in the scheduler, with no model: which requests draft, how many tokens, what a
verification leaves behind (outputs, computed tokens, blocks, prefix-cache entries), and a
step scheduled behind drafts that are then rejected."""

from __future__ import annotations

from scheduler_helpers import resolve_step

from scheduler import Request, SamplingParams, Scheduler, SchedulerConfig
from scheduler.request import PENDING_TOKEN
from scheduler.spec_decode.config import SpeculativeConfig

LOOP = [5, 6, 7, 8] * 4  # 16 tokens: the lookup drafts 5 6 7 8 ...


def make(num_blocks=64, budget=64, **config) -> Scheduler:
    speculative = SpeculativeConfig(method="ngram", num_speculative_tokens=3,
                                    prompt_lookup_min=1, prompt_lookup_max=2)
    return Scheduler(SchedulerConfig(num_blocks=num_blocks, block_size=4, max_num_seqs=8,
                                     max_num_batched_tokens=budget, max_model_len=256,
                                     speculative=speculative, **config))


def add(s: Scheduler, rid: str, prompt=LOOP, max_tokens=20, **params) -> Request:
    request = Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **params),
                      eos_token_ids=(2,))
    s.add_request(request)
    return request


def prefill(s: Scheduler, token: int = 5):
    out = s.schedule()
    resolve_step(s, out, {x.request_id: token for x in out.scheduled if x.samples})


def test_a_decoding_request_feeds_its_drafts_after_its_last_token():
    s = make()
    request = add(s, "a")
    prefill(s)  # first output 5: the lookup continues the loop
    out = s.schedule()
    (item,) = out.scheduled
    assert item.token_ids == [5, 6, 7, 8] and item.draft_token_ids == [6, 7, 8]
    assert item.start_position == 16 and len(item.block_ids) == 5  # up to position 19
    updates = resolve_step(s, out, {"a": [6, 7, 9]})  # two accepted, then 9
    assert [u.new_token_ids for u in updates] == [[6, 7, 9]]
    assert updates[0].num_output_tokens == 4 and updates[0].num_draft_tokens == 3
    assert request.output_token_ids == [5, 6, 7, 9]
    assert request.num_computed_tokens == 19  # 5 6 7 computed; 9 is next step's input
    assert (request.num_draft_tokens, request.num_accepted_tokens) == (3, 2)
    assert s.drafter.stats.accepted_per_position == [1, 1, 0]


def test_only_accepted_tokens_reach_the_prefix_cache():
    s = make()
    request = add(s, "a")
    prefill(s)
    out = s.schedule()
    resolve_step(s, out, {"a": [9]})  # the first draft rejected: 5 computed, 9 next
    assert request.num_computed_tokens == 17
    assert request.num_hashed_blocks == 4  # block 4 (16..19) is not full of accepted tokens
    assert request.all_token_ids[16:] == [5, 9]


def test_a_stop_token_inside_the_accepted_drafts_ends_the_request_there():
    s = make()
    request = add(s, "a", stop_token_ids=[7])
    prefill(s)
    out = s.schedule()
    (update,) = resolve_step(s, out, {"a": [6, 7, 8, 5]})
    assert update.new_token_ids == [6, 7] and update.finish_reason == "stop"
    assert request.output_token_ids == [5, 6, 7]
    assert s.pool.num_free_blocks == 64


def test_drafts_stay_within_max_tokens_and_the_token_budget():
    s = make(budget=18)
    add(s, "a", max_tokens=3)
    prefill(s)
    out = s.schedule()
    assert out.scheduled[0].draft_token_ids == [6]  # 1 + 1 draft outputs reach max_tokens 3
    s2 = make(budget=17)
    add(s2, "a")
    add(s2, "b", prompt=[9] * 15)
    prefill(s2)
    out = s2.schedule()
    assert sum(len(s.token_ids) for s in out.scheduled) <= 17


def test_drafts_never_take_blocks_from_others():
    s = make(num_blocks=8)  # two 15-token prompts fill 4 blocks of 4 each: none left
    add(s, "a", prompt=LOOP[:15], max_tokens=17)
    add(s, "b", prompt=[9] * 15, max_tokens=17)
    prefill(s, token=8)
    out = s.schedule()  # each decodes position 15, the last of its 4th block
    assert [x.token_ids for x in out.scheduled] == [[8], [8]]
    assert [x.draft_token_ids for x in out.scheduled] == [[], []]
    assert s.num_preemptions == 0


def test_a_step_scheduled_behind_rejected_drafts_is_ignored():
    """Async: step 2 is scheduled while step 1's drafts are unverified, taking them as
    accepted; step 1 rejects one, so step 2's share of the request is stale."""
    s = make()
    request = add(s, "a")
    prefill(s)
    first = s.schedule()
    s.advance(first)
    assert request.output_token_ids[-4:] == [6, 7, 8, PENDING_TOKEN]
    second = s.schedule()
    (item,) = second.scheduled
    assert item.start_position == 20 and item.token_ids[0] == PENDING_TOKEN
    s.advance(second)
    updates = s.resolve(first, {"a": [6, 1]})  # 7 rejected: 1 instead
    assert [u.new_token_ids for u in updates] == [[6, 1]]
    assert request.output_token_ids == [5, 6, 1] and request.num_computed_tokens == 18
    assert s.resolve(second, {"a": [5, 6]}) == []  # stale: ignored
    assert request.output_token_ids == [5, 6, 1]
    third = s.schedule()
    assert third.scheduled[0].start_position == 18 and third.scheduled[0].token_ids[0] == 1


def test_penalties_draft_only_with_their_history_known():
    s = make()
    request = add(s, "a", repetition_penalty=1.2)
    prefill(s)
    out = s.schedule()
    assert out.scheduled[0].draft_token_ids  # history known: drafts
    s.advance(out)
    behind = s.schedule()  # behind the pending token: none
    assert behind.scheduled[0].draft_token_ids == [] and request.has_pending_output


# ---- hybrid models: the state snapshot --------------------------------------------------------


def hybrid(**config) -> Scheduler:
    return make(num_state_slots=16, state_checkpoint_interval=1, **config)


def prefill_all(s: Scheduler, request: Request, token: int = 5) -> None:
    """Step until the request has its first output (prompts are cut at checkpoints)."""
    while not request.output_token_ids:
        prefill(s, token)


def test_a_snapshot_of_a_state_restored_this_step_copies_the_checkpoint():
    """The plan's copies run as one batch (reads before writes): a request admitted over a
    checkpoint with one token left to compute drafts at once, and its snapshot must be taken
    from the checkpoint, not from the live slot that the same batch fills."""
    s = hybrid()
    prompt = [5, 6, 7, 8] * 4 + [5]  # 17 tokens: the last full block ends at 16
    a = add(s, "a", prompt=prompt, max_tokens=8)
    prefill_all(s, a)
    while s.has_unfinished_requests():
        prefill(s, token=2)  # eos: ends it; its checkpoint at 16 stays
    add(s, "b", prompt=prompt)
    out = s.schedule()
    (item,) = out.scheduled
    assert item.token_ids[0] == 5 and item.draft_token_ids  # one prompt token, then drafts
    restores = out.state_plan.restores
    held = s.group("states").slots["b"]
    checkpoint = next(source for source, target in restores if target == held.live)
    assert (checkpoint, held.snapshot) in restores


def test_after_a_rejection_the_snapshot_becomes_the_live_state():
    s = hybrid()
    request = add(s, "a", prompt=LOOP[:12])  # decodes from 12: room for 2 drafts in block 3
    prefill_all(s, request)
    out = s.schedule()
    held = s.group("states").slots["a"]
    live, snapshot = held.live, held.snapshot
    assert out.scheduled[0].draft_token_ids and (live, snapshot) in out.state_plan.restores
    free = s.group("states").num_free_slots
    resolve_step(s, out, {"a": [9]})  # the first draft rejected
    assert held.live == snapshot and held.snapshot is None
    assert s.group("states").num_free_slots == free + 1  # the state past the drafts is dropped
    assert request.num_computed_tokens == 12  # recompute from the last known token
    again = s.schedule()
    assert again.scheduled[0].token_ids[:2] == [5, 9] and again.state_plan.restores == []


def test_no_drafts_in_a_step_that_preempts():
    s = make(num_blocks=10, budget=64)
    add(s, "a", prompt=LOOP[:15], max_tokens=20)
    add(s, "b", prompt=[9] * 15, max_tokens=20)
    prefill(s, token=8)
    for _ in range(6):
        out = s.schedule()
        if s.num_preemptions:
            assert all(not x.draft_token_ids for x in out.scheduled)
            return
        resolve_step(s, out, {x.request_id: [8] * (len(x.draft_token_ids) + 1)
                       for x in out.scheduled if x.samples})
    raise AssertionError("the pool never ran short")
