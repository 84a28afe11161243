"""Drive the single-threaded LLMEngine from asyncio handlers.

One background thread owns the engine (server.bridge.engine_thread): it applies queued adds
and aborts, then steps, and sleeps while no request is live. Each request's deltas travel to
its handler through an `asyncio.Queue` fed with `loop.call_soon_threadsafe`.

    handler ──add/abort──▶ [pending, under lock] ──▶ engine thread: apply → step → stats
    handler ◀──RequestOutput / exception── per-request asyncio.Queue ◀──┘

A failure inside one request (refused or failed add, an output that cannot be delivered)
fails that request only. A step that raises fails the live requests (the bridge cannot tell
which of them it ran) and leaves the engine to the next request. The thread lives on, unless
the engine cannot go on (`RankLost`: a tensor-parallel rank is gone): then the server shuts
down as on SIGTERM, and `fatal` says why.

This module is the handlers' side; server/bridge/ holds the parts it composes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeVar

from metal_engine.outputs import EngineStats, RequestOutput
from server.bridge.admission import Admission
from server.bridge.engine_thread import EngineThread
from server.bridge.errors import EngineError, QueueFull
from server.bridge.grammar_worker import GrammarWorker
from server.bridge.interfaces import Engine, NoObserver, RequestObserver
from server.bridge.live_requests import LiveRequest
from server.bridge.lora_adapters import LoraAdapters
from server.bridge.request_log import log_finish, log_queued
from server.bridge.stream import QueuedAdd, RequestStream
from server.http.logs import current_request_id
from server.http.tenants import current_tenant
from server.media.options import MediaOptions
from server.prompt_worker import LONG_PROMPTS_WAITING_BYTES, PromptWorker, max_prompt_text_bytes
from server.sampling_defaults import SamplingDefaults

if TYPE_CHECKING:
    from pathlib import Path

    from scheduler import SamplingParams
    from scheduler.media import PromptMedia
    from scheduler.pooling_params import PoolingParams

__all__ = ["AsyncEngine", "Engine", "EngineError", "LiveRequest", "QueueFull", "RequestObserver"]

T = TypeVar("T")
log = logging.getLogger(__name__)


class AsyncEngine:
    """Async front of an engine that only one thread may touch.

    `generate` and `prepare` may be called from any event loop; `tokenizer`, `model_name`,
    `max_model_len`, `max_prompt_bytes`, `sampling_defaults` (what requests get for the
    sampling fields they leave unset), `vision` (whether the model reads images) and `media`
    (where images may come from, and their limits) are read-only and safe to use from
    handlers, and `adapters` (the LoRA adapters requests may name) is theirs to use; `stats()`
    is a snapshot the engine thread publishes after every step, and `live_requests()` what the
    handlers have seen of theirs. At most `max_queued_requests` requests (None:
    no limit) may wait for their first output; more raise `QueueFull`. Without
    `report_cached_tokens`, every output says 0 cached tokens (the hits are still used).
    """

    def __init__(
        self, engine: Engine, max_queued_requests: int | None = None, log_prompts: bool = False,
        sampling_defaults: SamplingDefaults | None = None, report_cached_tokens: bool = True,
        media: MediaOptions | None = None, lora_paths: Mapping[str, Path] | None = None,
    ) -> None:
        self.engine = engine
        self.sampling_defaults = sampling_defaults or SamplingDefaults()
        # The model's vision side (prompt workers place images with it), if it reads images.
        self.image_model = getattr(engine, "image_model", None)
        self.media = media or MediaOptions()
        self.log_prompts = log_prompts
        self.report_cached_tokens = report_cached_tokens
        self.fatal: str | None = None  # why the engine cannot go on, once it cannot
        self._fatal_lock = threading.Lock()
        self._admission = Admission(max_queued_requests)
        self._thread = EngineThread(engine, self.report_fatal)
        # The loaded LoRA adapters (`lora_paths`: where those loaded at start came from).
        self.adapters = LoraAdapters(engine, self.run_on_engine_thread, lora_paths)
        self._observe: Callable[[], RequestObserver] = NoObserver
        self._live_requests: dict[str, LiveRequest] = {}  # handlers' side (their event loop)
        self._grammars = GrammarWorker(engine)
        self._prompts = PromptWorker()
        # Prompt text longer than this cannot fit the context: refused before tokenizing.
        self.max_prompt_bytes = max_prompt_text_bytes(engine.tokenizer, engine.max_model_len)

    @property
    def vision(self) -> bool:
        return self.image_model is not None

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def max_queued_requests(self) -> int | None:
        return self._admission.limit

    def prompts_waiting(self) -> int:
        """Prompts waiting to be rendered and tokenized, their clients still connected."""
        return self._prompts.waiting()

    async def prepare(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)`, which renders and tokenizes a prompt, on the prompt worker
        (server.prompt_worker). Its request counts as waiting for its first token meanwhile:
        past `max_queued_requests`, `QueueFull`; a client that leaves, `ClientGone`."""
        if not self._prompts.admits():
            raise QueueFull(LONG_PROMPTS_WAITING_BYTES >> 20, "MiB of long prompts")
        self._admission.admit()
        try:
            return await self._prompts.run(fn, *args)
        finally:
            self._admission.release()

    def observe_requests(self, observer: Callable[[], RequestObserver]) -> None:
        """Give every request from now on an observer made by `observer()`."""
        self._observe = observer

    def stats(self) -> EngineStats:
        return self._thread.stats()

    def live_requests(self) -> list[LiveRequest]:
        """The requests handlers wait on, oldest first; call it from their event loop."""
        return list(self._live_requests.values())

    def start(self) -> None:
        """Start the engine thread (idempotent; `generate` calls it too)."""
        self._thread.start()

    def run_on_engine_thread(self, fn: Callable[[], T]) -> T:
        """`fn()` on the engine thread, between steps (starting the thread); blocks until it
        returns. For engine work that must share the steps' thread, as the warm-up does."""
        return self._thread.call(fn)

    def abort_all(self) -> None:
        """End every live request now; each gets a last output with finish_reason "abort"."""
        self._thread.abort_all()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread for good; requests still live fail with `EngineError`."""
        self._thread.stop()
        self._grammars.stop()
        self._prompts.stop()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def report_fatal(self, reason: str) -> None:
        """The engine cannot go on (from any thread): shut the server down as SIGTERM does
        (live requests fail or drain; `serve` then exits non-zero)."""
        with self._fatal_lock:
            if self.fatal is not None:
                return
            self.fatal = reason
        log.error("%s: shutting the server down", reason)
        os.kill(os.getpid(), signal.SIGTERM)

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str, priority: int = 0,
        cache_salt: str | None = None, media: PromptMedia | None = None,
        pooling: PoolingParams | None = None, lora_name: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's deltas until one is finished. It shares prefix-cache blocks
        only with requests of the same `cache_salt`; `media`: its prompt's images; `pooling`:
        it pools its prompt instead (one output, with `pooled`); `lora_name`: the loaded
        LoRA adapter that serves it (None: the base model).

        Raises `QueueFull` if too many requests wait already, the engine's `ValueError` if it
        refuses the request (both before any output), and `EngineError` if the engine fails.
        Stopping early (a client disconnect cancels the consumer) aborts the request.
        """
        stream = RequestStream(asyncio.get_running_loop(), current_request_id(), len(prompt_ids))
        observer = self._observe()
        try:
            await self._submit(QueuedAdd(request_id, list(prompt_ids), params, priority,
                                         cache_salt, stream, media, pooling, lora_name))
        except (ValueError, QueueFull):
            observer.on_finish("rejected")
            raise
        started, awaiting_first, done = time.monotonic(), True, False
        live = LiveRequest(request_id, stream.log_id, started, len(prompt_ids),
                           log_queued(request_id, prompt_ids, self.tokenizer, self.log_prompts),
                           current_tenant())
        self._live_requests[request_id] = live
        outcome, last = "abort", None  # "abort" unless the request ends on its own
        try:
            while not done:
                item = await stream.queue.get()
                if awaiting_first:
                    awaiting_first = False
                    self._admission.release()
                if isinstance(item, BaseException):
                    done = True  # the engine thread has already dropped the request
                    outcome = "rejected" if isinstance(item, ValueError) else "error"
                    raise item
                observer.on_output(item)
                live.record(item)
                done, last = item.finished, item
                outcome = item.finish_reason or outcome
                yield item if self.report_cached_tokens else replace(item, num_cached_tokens=0)
        finally:
            self._live_requests.pop(request_id, None)
            if awaiting_first:
                self._admission.release()
            if not done:
                self._thread.abort(request_id)
            observer.on_finish(outcome)
            log_finish(request_id, outcome, last, time.monotonic() - started)

    async def _submit(self, add: QueuedAdd) -> None:
        """Hand `add` to the engine thread, its grammar compiled first. Raises what a refused
        grammar raises (ValueError), `EngineError` once shut down, and `QueueFull`."""
        if add.params.structured is not None:
            await self._grammars.compile(add.params.structured)
        self._thread.start()
        self._admission.admit()
        self._thread.submit(add)
