"""A request's checks on its output beyond token ids (scheduler.stopping.OutputCheck): its
stop strings, on the text its detokenizer decodes, and its grammar, if it has one."""

from __future__ import annotations

import logging

from metal_engine.detokenizer import IncrementalDetokenizer
from metal_engine.sampling.structured import StructuredOutputs
from scheduler.stopping import Stop

log = logging.getLogger(__name__)


class RequestOutputCheck:
    """Fed each output token in order by the scheduler's stop judge; the engine takes the
    text deltas (`take_delta`)."""

    def __init__(self, request_id: str, detokenizer: IncrementalDetokenizer,
                 structured: StructuredOutputs) -> None:
        self.request_id, self.detokenizer, self.structured = request_id, detokenizer, structured

    def check(self, token_id: int) -> Stop | None:
        request_id, structured = self.request_id, self.structured
        grammar_complete = request_id in structured and structured.accept(request_id, token_id)
        error = structured.failure(request_id)
        stop_string = self.detokenizer.add_token(token_id)
        if error is not None:  # the output left its grammar: it fails, whatever else ends it
            log.warning("request %s: its grammar failed while generating; ending it", request_id)
            return Stop("error", error=error)
        if stop_string is not None:
            return Stop("stop", stop_string)
        return Stop("stop") if grammar_complete else None

    def take_delta(self, final: bool) -> str:
        return self.detokenizer.take_delta(final)
