"""Coding-agent sessions for prefix-cache tests: 8 sessions x 4 turns over a ~1k-token
system prompt, each turn resending the whole conversation with the answer and a tool result
appended, the next turn submitted as soon as the previous one finishes."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from metal_engine.engine import LLMEngine
from scheduler import SamplingParams

BLOCK = 16
SESSIONS, TURNS = 8, 4
SYSTEM_LEN, USER_LEN, ANSWER_LEN, TOOL_RESULT_LEN = 1000, 24, 12, 40
PARAMS = SamplingParams(max_tokens=ANSWER_LEN, temperature=0.0, ignore_eos=True)


class Agents:
    """Submits each session's turns and keeps the count a perfect prefix cache would reuse."""

    def __init__(self, add: Callable[[str, list[int]], None], rng: np.random.Generator,
                 turns: int = TURNS) -> None:
        self.add = add
        self.rng = rng
        self.turns = turns
        self.prompt_tokens = 0
        self.reusable_tokens = 0
        self.turns_done = 0

    def tokens(self, count: int) -> list[int]:
        return [int(t) for t in self.rng.integers(3, 128, size=count)]

    def submit(self, session: int, turn: int, prompt: list[int], reusable: int) -> None:
        self.add(f"s{session}-t{turn}", prompt)
        self.prompt_tokens += len(prompt)
        self.reusable_tokens += reusable

    def start(self, system: list[int]) -> None:
        # All first turns arrive together; one computes the system prompt's full blocks and the
        # others reuse them (the block where the system prompt ends differs per session).
        shared = SYSTEM_LEN // BLOCK * BLOCK
        for session in range(SESSIONS):
            self.submit(session, 0, system + self.tokens(USER_LEN), shared if session else 0)

    def next_turn(self, request_id: str, history: list[int]) -> None:
        """Resend the conversation with the answer and a tool result; the previous turn left
        the full blocks of all but its last token (a sampled token has no K/V yet) cached."""
        self.turns_done += 1
        session, turn = (int(part[1:]) for part in request_id.split("-"))
        if turn + 1 == self.turns:
            return
        reusable = (len(history) - 1) // BLOCK * BLOCK
        self.submit(session, turn + 1, history + self.tokens(TOOL_RESULT_LEN), reusable)


def run_turns(engine: LLMEngine, agents: Agents, prompts: dict[str, list[int]]
              ) -> dict[str, list[int]]:
    """Step until every submitted turn (and the turns they lead to) has finished; return
    each turn's conversation: its prompt and answer."""
    histories: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            rid = output.request_id
            histories[rid] = histories.get(rid, prompts[rid]) + output.new_token_ids
            if output.finished:
                agents.next_turn(rid, histories[rid])
    return histories
