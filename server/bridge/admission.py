"""The queue limit: how many requests may wait for their first output at once.

A request waits from the moment its prompt is queued for rendering until its first output
(or its end) reaches the handler. Past the limit the next one is refused with `QueueFull`,
which clients retry, rather than queued behind work the server cannot start soon.
"""

from __future__ import annotations

import threading

from server.bridge.errors import QueueFull


class Admission:
    """Counts the requests waiting for their first output; safe from any thread.
    `limit` None: no limit."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._num_waiting = 0  # under the lock

    def admit(self) -> None:
        """Count one more waiting request, or raise `QueueFull` if the limit is reached."""
        with self._lock:
            if self.limit is not None and self._num_waiting >= self.limit:
                raise QueueFull(self.limit)
            self._num_waiting += 1

    def release(self) -> None:
        """One admitted request no longer waits (it got an output, or ended)."""
        with self._lock:
            self._num_waiting -= 1
