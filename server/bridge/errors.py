"""What the bridge raises to a handler: an engine that failed or stopped, or a full queue.

Apart from the bridge itself so that the HTTP layer can map them to responses, and the engine
thread can raise them, without either importing the other.
"""

from __future__ import annotations


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
