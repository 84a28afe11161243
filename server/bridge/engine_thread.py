"""The one thread that touches the engine, and what handlers hand it.

Handlers queue adds, aborts, abort-everything and stop under one condition variable; the
thread takes them all at once, applies them, steps, publishes the engine's stats, and sleeps
on the condition while no request is live:

    handler ──add/abort──▶ [pending, under the lock] ──▶ apply → step → stats → deliver

`call` runs other engine work (the warm-up) on this thread, between steps: the CPU
backend's compiled loops run ~60% slower on a thread other than the one that first ran them.

A bug outside any one request fails the live requests and the thread serves on; only stop
ends it, failing what is still live and closing the engine.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from metal_engine.outputs import EngineStats
from server.bridge import log
from server.bridge.engine_driver import EngineDriver
from server.bridge.errors import EngineError
from server.bridge.interfaces import Engine
from server.bridge.stream import QueuedAdd

SHUTTING_DOWN = "The server is shutting down; retry on a running server."
T = TypeVar("T")


class _Call(Generic[T]):
    """A function queued for the engine thread, and what came of it."""

    def __init__(self, fn: Callable[[], T]) -> None:
        self._fn = fn
        self._done = threading.Event()
        self._result: T | None = None
        self._error: BaseException | None = None

    def run(self) -> None:
        try:
            self._result = self._fn()
        except BaseException as exc:  # the caller's to handle, on its own thread
            self._error = exc
        self._done.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._done.set()

    def outcome(self) -> T:
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[return-value]


class EngineThread(threading.Thread):
    """Safe to call from any thread: `start` (idempotent), `call`, `submit`, `abort`,
    `abort_all`, `stop`, `join` and `stats` (the snapshot published after every step).
    `on_fatal(reason)` runs on this thread when the engine cannot go on."""

    def __init__(self, engine: Engine, on_fatal: Callable[[str], None]) -> None:
        super().__init__(name="engine-loop", daemon=True)
        self._engine = engine
        self._driver = EngineDriver(engine, on_fatal)  # this thread only
        self._cond = threading.Condition()
        self._calls: list[_Call] = []  # under the lock, as are the five below
        self._adds: list[QueuedAdd] = []
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

    def call(self, fn: Callable[[], T]) -> T:
        """Run `fn()` on this thread before its next step; return what it returns or raise
        what it raises. Starts the thread."""
        call = _Call(fn)
        with self._cond:
            if self._stopping:
                raise EngineError(SHUTTING_DOWN)
            self._calls.append(call)
            self._cond.notify()
        self.start()
        return call.outcome()

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
        try:
            self._serve()
        finally:  # nobody waits forever on a call this thread will not run
            with self._cond:
                calls, self._calls = self._calls, []
            for call in calls:
                call.fail(EngineError(SHUTTING_DOWN))

    def _serve(self) -> None:
        self._publish_stats()
        while True:
            with self._cond:
                while not (self._calls or self._adds or self._aborts or self._abort_everything
                           or self._stopping or self._driver.is_live()):  # fmt: skip
                    self._cond.wait()
                calls, self._calls = self._calls, []
                adds, self._adds = self._adds, []
                aborts, self._aborts = self._aborts, []
                abort_everything, self._abort_everything = self._abort_everything, False
                stopping = self._stopping
            for call in calls:
                call.run()
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
