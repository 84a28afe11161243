"""Drive the single-threaded LLMEngine from asyncio handlers.

One background thread owns the engine: it applies queued adds and aborts, then steps, and
sleeps on a condition variable while no request is live. Each request's deltas travel to
its handler through an `asyncio.Queue` fed with `loop.call_soon_threadsafe`.

    handler ──add/abort──▶ [pending, under lock] ──▶ engine thread: apply → step
    handler ◀──RequestOutput / exception── per-request asyncio.Queue ◀──┘
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from metal_engine.outputs import RequestOutput
    from scheduler import SamplingParams

log = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """The engine failed while running a request, or stopped; the request cannot finish."""


class Engine(Protocol):
    """What the bridge needs from `LLMEngine`. None of it is thread-safe."""

    tokenizer: Any
    model_name: str
    max_model_len: int

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
    ) -> None: ...

    def abort_request(self, request_id: str) -> None: ...

    def has_unfinished_requests(self) -> bool: ...

    def step(self) -> list[RequestOutput]: ...

    def close(self) -> None:
        """Last call, on the engine thread: e.g. spill cached KV blocks to disk."""


@dataclass
class _Stream:
    """Where one request's outputs go: a queue living on the handler's event loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException] = field(default_factory=asyncio.Queue)

    def put(self, item: RequestOutput | BaseException) -> None:
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is waiting any more
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


@dataclass
class _Add:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    priority: int
    stream: _Stream


class AsyncEngine:
    """Async front of an engine that only one thread may touch.

    `generate` may be called from any event loop; `tokenizer`, `model_name` and
    `max_model_len` are read-only and safe to use from handlers.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._cond = threading.Condition()
        self._adds: list[_Add] = []
        self._aborts: list[str] = []
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._streams: dict[str, _Stream] = {}  # live requests; engine thread only

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def start(self) -> None:
        """Start the engine thread (idempotent; `generate` calls it too)."""
        with self._cond:
            self._start_locked()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread for good; requests still live fail with `EngineError`."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def _start_locked(self) -> None:
        if self._stopping:
            raise EngineError("The engine has been shut down; restart the server.")
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
            self._thread.start()

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str, priority: int = 0
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's deltas until one is finished.

        Raises the engine's `ValueError` if it refuses the request (before any output), and
        `EngineError` if the engine fails. Stopping early (a client disconnect cancels the
        consumer) aborts the request in the engine.
        """
        stream = _Stream(asyncio.get_running_loop())
        with self._cond:
            self._start_locked()
            self._adds.append(_Add(request_id, list(prompt_ids), params, priority, stream))
            self._cond.notify()
        done = False
        try:
            while not done:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    done = True  # the engine thread has already dropped the request
                    raise item
                done = item.finished
                yield item
        finally:
            if not done:
                self._abort(request_id)

    def _abort(self, request_id: str) -> None:
        with self._cond:
            self._aborts.append(request_id)
            self._cond.notify()

    # ---- engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._adds or self._aborts or self._stopping or self._live()):
                    self._cond.wait()
                adds, self._adds = self._adds, []
                aborts, self._aborts = self._aborts, []
                stopping = self._stopping
            self._apply(adds, aborts)
            if stopping:
                break
            if self._live():
                self._step()
        self._fail_all(EngineError("The server is shutting down; retry on a running server."))
        try:
            self.engine.close()
        except Exception:
            log.exception("closing the engine failed")

    def _live(self) -> bool:
        # The engine may hold work without a stream: an abort's output is flushed by a step.
        return bool(self._streams) or self.engine.has_unfinished_requests()

    def _apply(self, adds: list[_Add], aborts: list[str]) -> None:
        for add in adds:
            try:
                self.engine.add_request(
                    add.request_id, add.prompt_ids, add.params, priority=add.priority
                )
            except ValueError as exc:
                add.stream.put(exc)
                continue
            except Exception as exc:
                log.exception("engine.add_request failed for %s", add.request_id)
                add.stream.put(EngineError(f"The engine could not add the request: {exc!r}"))
                continue
            self._streams[add.request_id] = add.stream
        for request_id in aborts:
            if self._streams.pop(request_id, None) is not None:
                self.engine.abort_request(request_id)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            log.exception("engine step failed; failing %d live requests", len(self._streams))
            self._fail_all(EngineError(f"The engine failed while generating: {exc!r}"))
            return
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:  # aborted after this step was scheduled
                continue
            if output.finished:
                del self._streams[output.request_id]
            stream.put(output)

    def _fail_all(self, error: EngineError) -> None:
        streams, self._streams = self._streams, {}
        for request_id, stream in streams.items():
            try:
                self.engine.abort_request(request_id)
            except Exception:
                log.exception("could not abort %s after an engine failure", request_id)
            stream.put(error)
