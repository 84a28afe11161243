"""Compile structured-output grammars off the engine thread.

A pathological JSON schema takes seconds to compile, which on the engine thread would stall
every stream. The worker compiles a request's grammar first; the engine compiles it again at
add time and finds it cached.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from scheduler.sampling_params import StructuredOutput


class GrammarWorker:
    """One thread: a client sending many slow schemas delays only other grammars."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")

    async def compile(self, structured: StructuredOutput) -> None:
        """Compile `structured`'s grammar with the engine's compiler (none: nothing to do);
        a refusal is the engine's ValueError, raised here."""
        grammars = getattr(self._engine, "structured", None)
        if grammars is None:
            return
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._pool, grammars.compile, structured)

    def stop(self) -> None:
        """Drop the grammars not yet compiled; do not wait for the one compiling."""
        self._pool.shutdown(wait=False, cancel_futures=True)
