"""Requests waiting for admission, in the order the scheduling policy admits them."""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator

from scheduler.config import SchedulingPolicy
from scheduler.request import Request


def admission_key(policy: SchedulingPolicy) -> Callable[[Request], tuple[int, ...]]:
    """Sort key of a request under `policy`; the smallest key is admitted first.

    fcfs: arrival order. priority: lower `priority` first, arrival order among equals.
    The preemption victim is the running request with the largest key.
    """
    if policy == "priority":
        return lambda request: (request.priority, request.arrival_index)
    return lambda request: (request.arrival_index,)


class WaitingQueue:
    """New and preempted requests, kept sorted by the policy's admission key.

    A preempted request goes back to its place by key: under fcfs that is ahead of every
    request that arrived after it.
    """

    def __init__(self, policy: SchedulingPolicy) -> None:
        self.key = admission_key(policy)
        self._requests: list[Request] = []

    def add(self, request: Request) -> None:
        bisect.insort(self._requests, request, key=self.key)

    def remove(self, request: Request) -> None:
        self._requests.remove(request)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._requests)

    def __len__(self) -> int:
        return len(self._requests)
