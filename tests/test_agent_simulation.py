"""Coding agents on a tiny random Llama, through the scheduler and the real runner.

8 sessions x 4 turns share a ~1k-token system prompt. Each turn resends the whole
conversation with the assistant's answer and a tool result appended, and a session's next
turn starts as soon as its previous one finishes. The test prints the prefix hit rate and the
prefill tokens saved, and holds the hit rate to what a prefix cache must reuse here.
"""

from __future__ import annotations

import numpy as np
from engine_helpers import make_runner_and_scheduler

from scheduler import Request, SamplingParams, Scheduler

BLOCK = 16
SESSIONS, TURNS = 8, 4
SYSTEM_LEN, USER_LEN, ANSWER_LEN, TOOL_RESULT_LEN = 1000, 24, 12, 40
PARAMS = SamplingParams(max_tokens=ANSWER_LEN, temperature=0.0, ignore_eos=True)


class Agents:
    """Submits each session's turns and keeps the count a perfect prefix cache would reuse."""

    def __init__(self, scheduler: Scheduler, rng: np.random.Generator) -> None:
        self.scheduler = scheduler
        self.rng = rng
        self.prompt_tokens = 0
        self.reusable_tokens = 0
        self.turns_done = 0

    def tokens(self, count: int) -> list[int]:
        return [int(t) for t in self.rng.integers(3, 128, size=count)]

    def submit(self, session: int, turn: int, prompt: list[int], reusable: int) -> None:
        request = Request(f"s{session}-t{turn}", prompt, PARAMS, eos_token_ids=(2,))
        self.scheduler.add_request(request)
        self.prompt_tokens += len(prompt)
        self.reusable_tokens += reusable

    def start(self, system: list[int]) -> None:
        # All first turns arrive together; one computes the system prompt's full blocks and the
        # others reuse them (the block where the system prompt ends differs per session).
        shared = SYSTEM_LEN // BLOCK * BLOCK
        for session in range(SESSIONS):
            self.submit(session, 0, system + self.tokens(USER_LEN), shared if session else 0)

    def next_turn(self, finished: Request) -> None:
        """Resend the conversation with the answer and a tool result; the previous turn left
        the full blocks of all but its last token (a sampled token has no K/V yet) cached."""
        self.turns_done += 1
        session, turn = (int(part[1:]) for part in finished.request_id.split("-"))
        if turn + 1 == TURNS:
            return
        history = finished.all_token_ids
        reusable = (len(history) - 1) // BLOCK * BLOCK
        self.submit(session, turn + 1, history + self.tokens(TOOL_RESULT_LEN), reusable)


def test_agent_sessions_reuse_the_system_prompt_and_their_history(tiny_llama):
    # A budget above the system prompt: without the wait for blocks in flight, the first
    # turns would all compute it side by side in the first step.
    runner, scheduler = make_runner_and_scheduler(
        tiny_llama[1], num_blocks=1024, block_size=BLOCK, max_num_seqs=SESSIONS,
        max_num_batched_tokens=2048, max_model_len=2048,
    )  # fmt: skip
    agents = Agents(scheduler, np.random.default_rng(5))
    agents.start(agents.tokens(SYSTEM_LEN))
    computed_prompt_tokens = 0
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        for item in out.scheduled:
            num_prompt = scheduler.requests[item.request_id].num_prompt_tokens
            computed_prompt_tokens += max(0, min(len(item.token_ids),
                                                 num_prompt - item.start_position))
        for update in scheduler.update(out, runner.execute(out)):
            if update.finish_reason is not None:
                agents.next_turn(update.request)

    stats = scheduler.prefix_cache.stats
    saved = agents.prompt_tokens - computed_prompt_tokens
    floor = agents.reusable_tokens / agents.prompt_tokens
    print(f"\n{SESSIONS} sessions x {TURNS} turns: prefix hit rate {stats.hit_rate:.1%} "
          f"(floor {floor:.1%}), prefill tokens saved {saved} of {agents.prompt_tokens}")
    assert agents.turns_done == SESSIONS * TURNS
    assert stats.queried_tokens == agents.prompt_tokens  # every request admitted once
    assert stats.hit_tokens == saved  # what the stats report is what was not computed
    assert stats.hit_rate >= floor
