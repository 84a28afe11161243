"""The parts of the bridge between asyncio handlers and the engine thread.

`server.async_engine.AsyncEngine` composes them and is what the rest of the server uses:
errors (what a handler may catch), interfaces (what the bridge needs of the engine and offers
observers), stream (one request's hand-off to the engine thread and back), engine_thread and
engine_driver (the one thread that touches the engine), admission (the queue limit),
grammar_worker, live_requests (for the dashboard) and request_log.
"""

from __future__ import annotations

import logging

# One logger for the whole bridge, under its public module's name: log settings that name
# `server.async_engine` keep seeing every line the bridge writes.
log = logging.getLogger("server.async_engine")
