"""Turns at stepping, for the engines of several models in one process.

Each engine thread takes a turn for each step, in the order the turns were asked for: a
saturated model's steps cannot crowd another's out (each waits for at most one step of each
other model), and on the CPU backend two steps never split the cores between them, which
makes both slower than taking turns.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class StepTurns:
    """A first-come, first-served lock (a ticket lock): `with turns.turn(): step()`."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._next_ticket = 0
        self._now_serving = 0

    @contextmanager
    def turn(self) -> Iterator[None]:
        with self._cond:
            ticket = self._next_ticket
            self._next_ticket += 1
            while ticket != self._now_serving:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._now_serving += 1
                self._cond.notify_all()
