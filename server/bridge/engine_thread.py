"""The one thread that touches the engine, and what handlers hand it.

Handlers queue adds, aborts, abort-everything and stop under one condition variable; the
thread takes them all at once, applies them, steps, publishes the engine's stats, and sleeps
on the condition while no request is live:

    handler ──add/abort──▶ [pending, under the lock] ──▶ apply → step → stats → deliver

A bug outside any one request fails the live requests and the thread serves on; only stop
ends it, failing what is still live and closing the engine.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from metal_engine.outputs import EngineStats
from server.bridge import log
from server.bridge.engine_driver import EngineDriver
from server.bridge.errors import EngineError
from server.bridge.interfaces import Engine
from server.bridge.stream import QueuedAdd

SHUTTING_DOWN = "The server is shutting down; retry on a running server."


class EngineThread(threading.Thread):
    """Safe to call from any thread: `start` (idempotent), `submit`, `abort`, `abort_all`,
    `stop`, `join` and `stats` (the snapshot published after every step). `on_fatal(reason)`
    runs on this thread when the engine cannot go on."""

    def __init__(self, engine: Engine, on_fatal: Callable[[str], None]) -> None:
        super().__init__(name="engine-loop", daemon=True)
        self._engine = engine
        self._driver = EngineDriver(engine, on_fatal)  # this thread only
        self._cond = threading.Condition()
        self._adds: list[QueuedAdd] = []  # under the lock, as are the four below
        self._aborts: list[str] = []
        self._abort_everything = False
        self._stopping = False
        self._stats = EngineStats()

    def start(self) -> None:
        """Start the thread once; later calls do nothing. Refused once stopped."""
        with self._cond:
            if self._stopping:
                raise EngineError("The engine has been shut down; restart the server.")
            if self.ident is None:
                super().start()

    def submit(self, add: QueuedAdd) -> None:
        """Queue a request for the engine. Once stopping, it fails at once, as the thread
        would have failed it on its way out."""
        with self._cond:
            if self._stopping:
                add.stream.put(EngineError(SHUTTING_DOWN))
                return
            self._adds.append(add)
            self._cond.notify()

    def abort(self, request_id: str) -> None:
        with self._cond:
            self._aborts.append(request_id)
            self._cond.notify()

    def abort_all(self) -> None:
        """End every live request now; each gets a last output with finish_reason "abort"."""
        with self._cond:
            self._abort_everything = True
            self._cond.notify()

    def stop(self) -> None:
        """Stop for good, without waiting (`join` does): live requests fail, the engine
        closes."""
        with self._cond:
            self._stopping = True
            self._cond.notify()

    def stats(self) -> EngineStats:
        with self._cond:
            return self._stats

    def run(self) -> None:
        self._publish_stats()
        while True:
            with self._cond:
                while not (self._adds or self._aborts or self._abort_everything
                           or self._stopping or self._driver.is_live()):  # fmt: skip
                    self._cond.wait()
                adds, self._adds = self._adds, []
                aborts, self._aborts = self._aborts, []
                abort_everything, self._abort_everything = self._abort_everything, False
                stopping = self._stopping
            if stopping:
                self._driver.apply(adds, aborts)
                break
            try:
                self._iterate(adds, aborts, abort_everything)
            except Exception as exc:  # a bug outside any one request: fail the live ones
                log.exception("the engine loop failed; failing %d requests", self._driver.num_live)
                self._driver.fail_all(EngineError("The engine failed", exc))
        self._driver.fail_all(EngineError(SHUTTING_DOWN))
        try:
            self._engine.close()
        except Exception:
            log.exception("closing the engine failed")

    def _iterate(self, adds: list[QueuedAdd], aborts: list[str], abort_everything: bool) -> None:
        """Apply what the handlers queued, then step once if anything is live."""
        self._driver.apply(adds, aborts)
        if abort_everything:
            self._driver.abort_live()
        outputs = self._driver.step() if self._driver.is_live() else []
        self._publish_stats()  # first: a client that got its last output sees it in /metrics
        for output in outputs:
            self._driver.deliver(output)

    def _publish_stats(self) -> None:
        stats = self._engine.stats()
        with self._cond:
            self._stats = stats
