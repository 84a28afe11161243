"""One request's way to the engine thread and back.

A handler hands the engine thread a `QueuedAdd`; the engine thread sends the request's
outputs, or the exception that ends it, through its `RequestStream`, whose queue lives on the
handler's event loop and is fed with `loop.call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from metal_engine.outputs import RequestOutput

if TYPE_CHECKING:
    from scheduler import SamplingParams
    from scheduler.media import PromptMedia
    from scheduler.pooling_params import PoolingParams


@dataclass
class RequestStream:
    """Where one request's outputs go: a queue living on the handler's event loop."""

    loop: asyncio.AbstractEventLoop
    log_id: str  # the HTTP request's id, for the engine thread's log lines
    num_prompt_tokens: int
    queue: asyncio.Queue[RequestOutput | BaseException] = field(default_factory=asyncio.Queue)
    last: RequestOutput | None = None  # engine thread only

    def put(self, item: RequestOutput | BaseException) -> None:
        """From the engine thread: hand `item` to the handler."""
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
class QueuedAdd:
    """An `add_request` call a handler queued for the engine thread, and where its outputs go."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    priority: int
    cache_salt: str | None
    stream: RequestStream
    media: PromptMedia | None = None  # its prompt's images
    pooling: PoolingParams | None = None  # a pooling request's (embeddings, rerank)
    lora_name: str | None = None  # the LoRA adapter that serves it (None: the base model)
