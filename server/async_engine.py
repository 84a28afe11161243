"""Drive the single-threaded LLMEngine from asyncio handlers.

One background thread owns the engine: it applies queued adds and aborts, then steps, and
sleeps on a condition variable while no request is live. Each request's deltas travel to
its handler through an `asyncio.Queue` fed with `loop.call_soon_threadsafe`.

    handler ──add/abort──▶ [pending, under lock] ──▶ engine thread: apply → step → stats
    handler ◀──RequestOutput / exception── per-request asyncio.Queue ◀──┘

A failure inside one request (refused or failed add, an output that cannot be delivered)
fails that request only. A step that raises fails the live requests (the bridge cannot tell
which of them it ran) and leaves the engine to the next request. The thread lives on, unless
the engine cannot go on (`RankLost`: a tensor-parallel rank is gone): then the server shuts
down as on SIGTERM, and `fatal` says why.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from metal_engine.outputs import EngineStats, RequestOutput
from metal_engine.parallel.group import RankLost
from server.http.logs import current_request_id
from server.http.tenants import current_tenant
from server.prompt_worker import LONG_PROMPTS_WAITING_BYTES, PromptWorker, max_prompt_text_bytes
from server.sampling_defaults import SamplingDefaults

if TYPE_CHECKING:
    from scheduler import SamplingParams
    from scheduler.sampling_params import StructuredOutput

T = TypeVar("T")
log = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """The engine failed while running a request, or stopped; the request cannot finish.

    `public` is what the client is told; `str()` adds the cause's repr, for the server's own
    use. A cause's text may quote the prompt, so no client sees it (the log has it).
    """

    def __init__(self, public: str, cause: BaseException | None = None) -> None:
        super().__init__(public if cause is None else f"{public}: {cause!r}")
        self.public = public if cause is None else f"{public}; the server log has the details."


class QueueFull(RuntimeError):
    """Too many requests wait for their first token; the client should retry shortly."""

    retry_after_s = 1

    def __init__(self, limit: int, what: str = "requests") -> None:
        super().__init__(
            f"The server already has {limit} {what} waiting to start; retry in a moment."
        )


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
        cache_salt: str | None = None,
    ) -> None: ...

    def abort_request(self, request_id: str) -> None: ...

    def has_unfinished_requests(self) -> bool: ...

    def step(self) -> list[RequestOutput]: ...

    def close(self) -> None:
        """Last call, on the engine thread: e.g. spill cached KV blocks to disk."""


class RequestObserver(Protocol):
    """Sees one request's outputs on its handler's event loop (e.g. to time them)."""

    def on_output(self, output: RequestOutput) -> None: ...

    def on_finish(self, outcome: str) -> None:
        """Once: the finish reason, "error" (engine failure) or "rejected" (never ran)."""


class _NoObserver:
    def on_output(self, output: RequestOutput) -> None:
        pass

    def on_finish(self, outcome: str) -> None:
        pass


@dataclass
class _Stream:
    """Where one request's outputs go: a queue living on the handler's event loop."""

    loop: asyncio.AbstractEventLoop
    log_id: str  # the HTTP request's id, for the engine thread's log lines
    num_prompt_tokens: int
    queue: asyncio.Queue[RequestOutput | BaseException] = field(default_factory=asyncio.Queue)
    last: RequestOutput | None = None  # engine thread only

    def put(self, item: RequestOutput | BaseException) -> None:
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is waiting any more
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    def abort_output(self, request_id: str) -> RequestOutput:
        """A last output saying the server ended the request (finish_reason "abort")."""
        last = self.last
        return RequestOutput(
            request_id=request_id,
            new_token_ids=[],
            new_text="",
            finish_reason="abort",
            num_prompt_tokens=last.num_prompt_tokens if last else self.num_prompt_tokens,
            num_output_tokens=last.num_output_tokens if last else 0,
            num_cached_tokens=last.num_cached_tokens if last else 0,
        )


@dataclass
class LiveRequest:
    """A request whose handler still waits on it, as the handlers see it: for the dashboard.
    Lives on the handlers' event loop; `prompt` is its text only with `log_prompts`, and
    `tenant` the API key's tenant that sent it (`server.http.auth.current_tenant`)."""

    request_id: str
    http_request_id: str
    started: float  # time.monotonic()
    num_prompt_tokens: int
    prompt: str | None = None
    tenant: str | None = None
    first_output_at: float | None = None
    last: RequestOutput | None = None  # the newest output its handler got


@dataclass
class _Add:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    priority: int
    cache_salt: str | None
    stream: _Stream


class AsyncEngine:
    """Async front of an engine that only one thread may touch.

    `generate` and `prepare` may be called from any event loop; `tokenizer`, `model_name`,
    `max_model_len`, `max_prompt_bytes` and `sampling_defaults` (what requests get for the
    sampling fields they leave unset) are read-only and safe to use from handlers; `stats()`
    is a snapshot the engine thread publishes after every step, and `live_requests()` what the
    handlers have seen of theirs. At most `max_queued_requests` requests (None:
    no limit) may wait for their first output; more raise `QueueFull`. Without
    `report_cached_tokens`, every output says 0 cached tokens (the hits are still used).
    """

    def __init__(
        self, engine: Engine, max_queued_requests: int | None = None, log_prompts: bool = False,
        sampling_defaults: SamplingDefaults | None = None, report_cached_tokens: bool = True,
    ) -> None:
        self.engine = engine
        self.sampling_defaults = sampling_defaults or SamplingDefaults()
        self.max_queued_requests = max_queued_requests
        self.log_prompts = log_prompts
        self.report_cached_tokens = report_cached_tokens
        self._cond = threading.Condition()
        self._adds: list[_Add] = []
        self._aborts: list[str] = []
        self._abort_everything = False
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._num_awaiting_first = 0  # under the lock
        self._stats = EngineStats()  # under the lock
        self._observe: Callable[[], RequestObserver] = _NoObserver
        self._streams: dict[str, _Stream] = {}  # live requests; engine thread only
        self._live_requests: dict[str, LiveRequest] = {}  # handlers' side (their event loop)
        self._stalled = False  # engine thread only: a step failed and nothing was added since
        self.fatal: str | None = None  # why the engine cannot go on, once it cannot
        # One at a time: a client sending many slow schemas delays only other grammars.
        self._grammar_worker = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._prompts = PromptWorker()
        # Prompt text longer than this cannot fit the context: refused before tokenizing.
        self.max_prompt_bytes = max_prompt_text_bytes(engine.tokenizer, engine.max_model_len)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def prompts_waiting(self) -> int:
        """Prompts waiting to be rendered and tokenized, their clients still connected."""
        return self._prompts.waiting()

    async def prepare(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)`, which renders and tokenizes a prompt, on the prompt worker
        (server.prompt_worker). Its request counts as waiting for its first token meanwhile:
        past `max_queued_requests`, `QueueFull`; a client that leaves, `ClientGone`."""
        if not self._prompts.admits():
            raise QueueFull(LONG_PROMPTS_WAITING_BYTES >> 20, "MiB of long prompts")
        with self._cond:
            if self._queue_full_locked():
                raise QueueFull(self.max_queued_requests)
            self._num_awaiting_first += 1
        try:
            return await self._prompts.run(fn, *args)
        finally:
            self._release_queue_slot()

    async def _compile_grammar(self, structured: StructuredOutput) -> None:
        """Compile a request's grammar on the grammar worker, off the engine thread: a
        pathological schema takes seconds, which on the engine thread would stall every
        stream. The engine compiles it again at add time and finds it cached. A refusal is
        the engine's ValueError, raised here."""
        grammars = getattr(self.engine, "structured", None)
        if grammars is None:
            return
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._grammar_worker, grammars.compile, structured)

    def observe_requests(self, observer: Callable[[], RequestObserver]) -> None:
        """Give every request from now on an observer made by `observer()`."""
        self._observe = observer

    def stats(self) -> EngineStats:
        with self._cond:
            return self._stats

    def live_requests(self) -> list[LiveRequest]:
        """The requests handlers wait on, oldest first; call it from their event loop."""
        return list(self._live_requests.values())

    def start(self) -> None:
        """Start the engine thread (idempotent; `generate` calls it too)."""
        with self._cond:
            self._start_locked()

    def abort_all(self) -> None:
        """End every live request now; each gets a last output with finish_reason "abort"."""
        with self._cond:
            self._abort_everything = True
            self._cond.notify()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread for good; requests still live fail with `EngineError`."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._grammar_worker.shutdown(wait=False, cancel_futures=True)
        self._prompts.stop()
        if self._thread is not None:
            self._thread.join(timeout)

    def report_fatal(self, reason: str) -> None:
        """The engine cannot go on (from any thread): shut the server down as SIGTERM does
        (live requests fail or drain; `serve` then exits non-zero)."""
        with self._cond:
            if self.fatal is not None:
                return
            self.fatal = reason
        log.error("%s: shutting the server down", reason)
        os.kill(os.getpid(), signal.SIGTERM)

    def _start_locked(self) -> None:
        if self._stopping:
            raise EngineError("The engine has been shut down; restart the server.")
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
            self._thread.start()

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str, priority: int = 0,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's deltas until one is finished. It shares prefix-cache blocks
        only with requests of the same `cache_salt`.

        Raises `QueueFull` if too many requests wait already, the engine's `ValueError` if it
        refuses the request (both before any output), and `EngineError` if the engine fails.
        Stopping early (a client disconnect cancels the consumer) aborts the request.
        """
        stream = _Stream(asyncio.get_running_loop(), current_request_id(), len(prompt_ids))
        observer = self._observe()
        if params.structured is not None:
            try:
                await self._compile_grammar(params.structured)
            except ValueError:
                observer.on_finish("rejected")
                raise
        with self._cond:
            self._start_locked()
            if self._queue_full_locked():
                observer.on_finish("rejected")
                raise QueueFull(self.max_queued_requests)
            self._num_awaiting_first += 1
            add = _Add(request_id, list(prompt_ids), params, priority, cache_salt, stream)
            self._adds.append(add)
            self._cond.notify()
        started, awaiting_first, done = time.monotonic(), True, False
        live = LiveRequest(request_id, stream.log_id, started, len(prompt_ids),
                           self._log_prompt(request_id, prompt_ids), current_tenant())
        self._live_requests[request_id] = live
        outcome, last = "abort", None  # "abort" unless the request ends on its own
        try:
            while not done:
                item = await stream.queue.get()
                if awaiting_first:
                    awaiting_first = False
                    self._release_queue_slot()
                if isinstance(item, BaseException):
                    done = True  # the engine thread has already dropped the request
                    outcome = "rejected" if isinstance(item, ValueError) else "error"
                    raise item
                observer.on_output(item)
                if live.first_output_at is None:
                    live.first_output_at = time.monotonic()
                done, last = item.finished, item
                live.last = item
                outcome = item.finish_reason or outcome
                yield item if self.report_cached_tokens else replace(item, num_cached_tokens=0)
        finally:
            self._live_requests.pop(request_id, None)
            if awaiting_first:
                self._release_queue_slot()
            if not done:
                self._abort(request_id)
            observer.on_finish(outcome)
            _log_finish(request_id, outcome, last, time.monotonic() - started)

    def _queue_full_locked(self) -> bool:
        limit = self.max_queued_requests
        return limit is not None and self._num_awaiting_first >= limit

    def _release_queue_slot(self) -> None:
        with self._cond:
            self._num_awaiting_first -= 1

    def _log_prompt(self, request_id: str, prompt_ids: list[int]) -> str | None:
        """Log the request; the prompt's text, returned, only with --log-prompts: otherwise
        it stays out of the logs (and the dashboard)."""
        if not self.log_prompts:
            log.debug("%s queued with %d prompt tokens", request_id, len(prompt_ids))
            return None
        text = self.tokenizer.decode(prompt_ids)
        log.info("%s prompt: %r", request_id, text)
        return text

    def _abort(self, request_id: str) -> None:
        with self._cond:
            self._aborts.append(request_id)
            self._cond.notify()

    # ---- engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        self._publish_stats()
        while True:
            with self._cond:
                while not (self._adds or self._aborts or self._abort_everything
                           or self._stopping or self._live()):  # fmt: skip
                    self._cond.wait()
                adds, self._adds = self._adds, []
                aborts, self._aborts = self._aborts, []
                abort_everything, self._abort_everything = self._abort_everything, False
                stopping = self._stopping
            if stopping:
                self._apply(adds, aborts)
                break
            try:
                self._iterate(adds, aborts, abort_everything)
            except Exception as exc:  # a bug outside any one request: fail the live ones
                log.exception("the engine loop failed; failing %d requests", len(self._streams))
                self._fail_all(EngineError("The engine failed", exc))
        self._fail_all(EngineError("The server is shutting down; retry on a running server."))
        try:
            self.engine.close()
        except Exception:
            log.exception("closing the engine failed")

    def _iterate(self, adds: list[_Add], aborts: list[str], abort_everything: bool) -> None:
        """Apply what the handlers queued, then step once if anything is live."""
        self._apply(adds, aborts)
        if abort_everything:
            self._abort_live()
        outputs = self._step() if self._live() else []
        self._publish_stats()  # first: a client that got its last output sees it in /metrics
        for output in outputs:
            self._deliver(output)

    def _live(self) -> bool:
        # The engine may hold work without a stream: an abort's output is flushed by a step.
        # After a failed step, leftovers wait for the next add rather than failing in a loop.
        if self._streams:
            return True
        return not self._stalled and self.engine.has_unfinished_requests()

    def _publish_stats(self) -> None:
        stats = self.engine.stats()
        with self._cond:
            self._stats = stats

    def _apply(self, adds: list[_Add], aborts: list[str]) -> None:
        for add in adds:
            self._add(add)
        for request_id in aborts:
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                self._abort_in_engine(request_id, stream)

    def _add(self, add: _Add) -> None:
        try:
            self.engine.add_request(add.request_id, add.prompt_ids, add.params,
                                    priority=add.priority, cache_salt=add.cache_salt)
        except ValueError as exc:
            add.stream.put(exc)
            return
        except Exception as exc:
            log.exception("engine.add_request failed for %s", add.request_id,
                          extra={"request_id": add.stream.log_id})  # fmt: skip
            add.stream.put(EngineError("The engine could not add the request", exc))
            return
        self._streams[add.request_id] = add.stream
        self._stalled = False

    def _step(self) -> list[RequestOutput]:
        try:
            return self.engine.step()
        except RankLost as exc:
            log.exception("a rank was lost; failing %d requests", len(self._streams))
            self._fail_all(EngineError("The server lost one of its ranks", exc))
            self._stalled = True
            self.report_fatal(str(exc))
            return []
        except Exception as exc:
            log.exception("engine step failed; failing its %d requests", len(self._streams))
            self._fail_all(EngineError("The engine failed while generating", exc))
            self._stalled = True
            return []

    def _deliver(self, output: RequestOutput) -> None:
        stream = self._streams.get(output.request_id)
        if stream is None:  # aborted after this step was scheduled
            return
        try:
            if output.finished:
                del self._streams[output.request_id]
            stream.last = output
            stream.put(output)
        except Exception as exc:
            log.exception("could not deliver an output of %s", output.request_id,
                          extra={"request_id": stream.log_id})  # fmt: skip
            self._streams.pop(output.request_id, None)
            self._abort_in_engine(output.request_id, stream)
            stream.put(EngineError("The server could not deliver the output", exc))

    def _abort_live(self) -> None:
        streams, self._streams = self._streams, {}
        for request_id, stream in streams.items():
            self._abort_in_engine(request_id, stream)
            stream.put(stream.abort_output(request_id))

    def _fail_all(self, error: EngineError) -> None:
        streams, self._streams = self._streams, {}
        for request_id, stream in streams.items():
            self._abort_in_engine(request_id, stream)
            stream.put(error)

    def _abort_in_engine(self, request_id: str, stream: _Stream) -> None:
        try:
            self.engine.abort_request(request_id)
        except Exception:
            log.exception("could not abort %s", request_id, extra={"request_id": stream.log_id})


def _log_finish(request_id: str, outcome: str, last: RequestOutput | None, seconds: float) -> None:
    if last is None:
        log.info("%s ended (%s) before any output, after %.2fs", request_id, outcome, seconds)
        return
    drafts = ""
    if last.num_draft_tokens:
        drafts = (f", {last.num_accepted_tokens} of {last.num_draft_tokens} draft tokens "
                  "accepted")
    log.info(
        "%s ended (%s): %d prompt tokens (%d cached), %d generated%s, %.2fs", request_id,
        outcome, last.num_prompt_tokens, last.num_cached_tokens, last.num_output_tokens, drafts,
        seconds,
    )  # fmt: skip
