"""What the bridge needs from the engine, and what it offers whoever observes requests.

Protocols rather than imports, so that tests drive the bridge with a scripted engine and
the metrics module observes requests without either depending on the other's classes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from metal_engine.outputs import EngineStats, RequestOutput
    from scheduler import SamplingParams


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

    def stats(self) -> EngineStats: ...

    def close(self) -> None:
        """Last call, on the engine thread: e.g. spill cached KV blocks to disk."""


class RequestObserver(Protocol):
    """Sees one request's outputs on its handler's event loop (e.g. to time them)."""

    def on_output(self, output: RequestOutput) -> None: ...

    def on_finish(self, outcome: str) -> None:
        """Once: the finish reason, "error" (engine failure) or "rejected" (never ran)."""


class NoObserver:
    """The observer of every request until someone asks to observe them."""

    def on_output(self, output: RequestOutput) -> None:
        pass

    def on_finish(self, outcome: str) -> None:
        pass
