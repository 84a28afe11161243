"""The requests handlers wait on, as the handlers see them: what the dashboard lists.

Kept on the handlers' event loop, apart from the engine thread's own view, so the dashboard
reads them without a lock.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from metal_engine.outputs import RequestOutput


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

    def record(self, output: RequestOutput) -> None:
        """Its handler got `output`."""
        if self.first_output_at is None:
            self.first_output_at = time.monotonic()
        self.last = output
