"""Rendering and tokenizing prompts off the event loop, so that no client's prompt holds up
another's.

A megabyte prompt keeps the tokenizer busy for a second; on the event loop it would stall
every stream and `/health`. Two lanes, each one thread, take the jobs:

    request body < LONG_PROMPT_BYTES  ──▶ short lane ─┐  each lane: smallest body first,
    request body ≥ LONG_PROMPT_BYTES  ──▶ long lane  ─┘  a job whose client left is dropped

so a short prompt never waits behind a long one (the Rust tokenizer releases the GIL while
it encodes, so the two lanes do run side by side), and within a lane a flood of large bodies
goes after everyone else's. A job whose client disconnects before it runs is dropped, and its
handler stops waiting at once. The long lane's waiting bodies are bounded in bytes (`admits`).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from server.http.client_presence import ClientGone, client_gone, request_body_bytes

T = TypeVar("T")

# ~64k tokens of text: about a quarter second of tokenizing.
LONG_PROMPT_BYTES = 256 << 10
# The long lane's waiting bodies, held in memory until their turn: past this, a 429.
LONG_PROMPTS_WAITING_BYTES = 256 << 20


@dataclass(order=True)
class _Job:
    size: int
    order: int
    run: Callable[[], Any] = field(compare=False)
    future: asyncio.Future = field(compare=False)
    dropped: bool = field(default=False, compare=False)

    def execute(self) -> None:
        loop = self.future.get_loop()
        try:
            result = self.run()
        except BaseException as exc:  # handed to the waiting handler, raised there
            loop.call_soon_threadsafe(_settle, self.future, None, exc)
        else:
            loop.call_soon_threadsafe(_settle, self.future, result, None)


def _settle(future: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if future.done():  # its handler stopped waiting
        return
    if exc is None:
        future.set_result(result)
    else:
        future.set_exception(exc)


class _Lane:
    """One thread running jobs smallest first."""

    def __init__(self, name: str) -> None:
        self._cond = threading.Condition()
        self._heap: list[_Job] = []
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: _Job) -> None:
        with self._cond:
            heapq.heappush(self._heap, job)
            self._cond.notify()

    def waiting(self) -> int:
        with self._cond:
            return sum(not job.dropped for job in self._heap)

    def waiting_bytes(self) -> int:
        with self._cond:
            return sum(job.size for job in self._heap if not job.dropped)

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._heap and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                job = heapq.heappop(self._heap)
            if not job.dropped:
                job.execute()


class PromptWorker:
    """The two lanes. `run` may be called from any event loop; `waiting()` counts the jobs
    not yet started whose clients are still there."""

    def __init__(self) -> None:
        self._short = _Lane("prompt-short")
        self._long = _Lane("prompt-long")
        self._order = itertools.count()

    def waiting(self) -> int:
        return self._short.waiting() + self._long.waiting()

    def stop(self) -> None:
        self._short.stop()
        self._long.stop()

    def admits(self) -> bool:
        """Whether the current request's prompt may wait: a long one only while the long
        lane's waiting bodies stay under LONG_PROMPTS_WAITING_BYTES."""
        size = request_body_bytes()
        return (size < LONG_PROMPT_BYTES
                or self._long.waiting_bytes() + size <= LONG_PROMPTS_WAITING_BYTES)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` in the lane the current request's body size picks. Raises what `fn`
        raised, or `ClientGone` if the client disconnects first (the job is then dropped)."""
        size = request_body_bytes()
        future = asyncio.get_running_loop().create_future()
        job = _Job(size, next(self._order), lambda: fn(*args), future)
        (self._long if size >= LONG_PROMPT_BYTES else self._short).submit(job)
        gone = asyncio.ensure_future(client_gone())
        try:
            await asyncio.wait((future, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not future.done():  # the client left, or this handler was cancelled
                job.dropped = True
                future.cancel()
        if future.cancelled():
            raise ClientGone
        return future.result()


def max_prompt_text_bytes(tokenizer: Any, max_model_len: int) -> int | None:
    """Bytes of prompt text past which the prompt cannot fit in `max_model_len` tokens,
    whatever the text: no token covers more bytes than the longest in the vocabulary (twice
    that, for normalizers that shorten text). None for a tokenizer without a vocabulary."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return None
    longest = max((len(token.encode("utf-8")) for token in get_vocab()), default=0)
    return 2 * max_model_len * max(longest, 1)
