"""The heap the server starts serving with."""

from __future__ import annotations

import gc


def freeze_startup_objects() -> None:
    """Move every object alive now (modules, tokenizer, model metadata: they live as long as
    the server) out of the collector's reach. A full collection holds the GIL, so the event
    loop, for a time that grows with the objects it scans: without this one pause costs
    ~0.3 s per million startup objects, now it scans only what requests made."""
    gc.collect()
    gc.freeze()
