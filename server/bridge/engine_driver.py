"""What the engine thread does to the engine for the live requests: add, step, deliver, abort,
fail.

Only the engine thread touches an `EngineDriver`, so it holds no lock. A failure inside one
request (a refused or failed add, an output that cannot be delivered) fails that request
only; a step that raises fails every live request, since the driver cannot tell which of them
it ran.
"""

from __future__ import annotations

from collections.abc import Callable

from metal_engine.outputs import RequestOutput
from metal_engine.parallel.group import RankLost
from server.bridge import log
from server.bridge.errors import EngineError
from server.bridge.interfaces import Engine
from server.bridge.stream import QueuedAdd, RequestStream


class EngineDriver:
    """Keeps each live request's stream and moves work between them and the engine.
    `on_fatal(reason)` is called when the engine cannot go on (a tensor-parallel rank is gone)."""

    def __init__(self, engine: Engine, on_fatal: Callable[[str], None]) -> None:
        self.engine = engine
        self._on_fatal = on_fatal
        self._streams: dict[str, RequestStream] = {}  # the live requests
        self._stalled = False  # a step failed and nothing was added since

    @property
    def num_live(self) -> int:
        return len(self._streams)

    def is_live(self) -> bool:
        """Whether a step has work to do."""
        # The engine may hold work without a stream: an abort's output is flushed by a step.
        # After a failed step, leftovers wait for the next add rather than failing in a loop.
        if self._streams:
            return True
        return not self._stalled and self.engine.has_unfinished_requests()

    def apply(self, adds: list[QueuedAdd], aborts: list[str]) -> None:
        for add in adds:
            self._add(add)
        for request_id in aborts:
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                self._abort_in_engine(request_id, stream)

    def step(self) -> list[RequestOutput]:
        """One engine step; a failure fails the live requests and returns no outputs."""
        try:
            return self.engine.step()
        except RankLost as exc:
            log.exception("a rank was lost; failing %d requests", len(self._streams))
            self.fail_all(EngineError("The server lost one of its ranks", exc))
            self._stalled = True
            self._on_fatal(str(exc))
            return []
        except Exception as exc:
            log.exception("engine step failed; failing its %d requests", len(self._streams))
            self.fail_all(EngineError("The engine failed while generating", exc))
            self._stalled = True
            return []

    def deliver(self, output: RequestOutput) -> None:
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

    def abort_live(self) -> None:
        """End every live request with a last output whose finish_reason is "abort"."""
        streams, self._streams = self._streams, {}
        for request_id, stream in streams.items():
            self._abort_in_engine(request_id, stream)
            stream.put(stream.abort_output(request_id))

    def fail_all(self, error: EngineError) -> None:
        streams, self._streams = self._streams, {}
        for request_id, stream in streams.items():
            self._abort_in_engine(request_id, stream)
            stream.put(error)

    def _add(self, add: QueuedAdd) -> None:
        try:
            more = {} if add.media is None else {"media": add.media}  # only to a reader
            if add.pooling is not None:  # only to an engine that pools
                more["pooling"] = add.pooling
            if add.lora_name is not None:  # only to an engine that serves adapters
                more["lora_name"] = add.lora_name
            self.engine.add_request(add.request_id, add.prompt_ids, add.params,
                                    priority=add.priority, cache_salt=add.cache_salt, **more)
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

    def _abort_in_engine(self, request_id: str, stream: RequestStream) -> None:
        try:
            self.engine.abort_request(request_id)
        except Exception:
            log.exception("could not abort %s", request_id, extra={"request_id": stream.log_id})
