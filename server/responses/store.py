"""Finished responses kept in memory, for `previous_response_id` and `GET`/`DELETE
/v1/responses/{id}` (vLLM's in-memory store, with bounds).

An entry is the response as it was sent (a JSON dict) and the conversation it ends: every
input item that led to it (those of the responses it continued from included) followed by its
output items as input items. A follow-up's prompt is that conversation plus its own input, so
it still works after the responses before it were evicted or deleted.

`store` defaults to true, as in OpenAI's API: SDK code that omits it and then sends
`previous_response_id` must find its response. Clients that want nothing kept send
`store: false` (Codex does). Only `completed` and `incomplete` responses are kept; a failed
one, or one whose client left before its end, is not (there is nothing to continue from).

Each owner (an API key; None without keys, all callers then being one) has its own entries and
its own bounds: at most `max_responses` entries and `max_bytes` of them (their JSON size), the
least recently used (stored, read or continued from) evicted first. One owner can neither see
another's entries (an id it does not own is unknown to it) nor evict them.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from server.responses.protocol import InputItem, OutputItem

STORE_BY_DEFAULT = True  # OpenAI's default for `store`
MAX_RESPONSES = 1024  # per owner
MAX_BYTES = 64 << 20  # per owner, the entries' JSON size


@dataclass(frozen=True)
class StoreLimits:
    max_responses: int = MAX_RESPONSES
    max_bytes: int = MAX_BYTES

    def __post_init__(self) -> None:
        if self.max_responses < 1 or self.max_bytes < 1:
            raise ValueError(
                f"response store limits must be positive, got max_responses="
                f"{self.max_responses} and max_bytes={self.max_bytes}"
            )


DEFAULT_LIMITS = StoreLimits()


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # as the client got it
    conversation: tuple[InputItem, ...]  # every item up to and including its output
    conversation_bytes: int  # their JSON size; a follow-up's adds to it
    size: int  # what the entry counts against `max_bytes`: the above and the response's


def as_input(item: OutputItem) -> InputItem:
    """An output item as the input item that sends it back."""
    return InputItem.model_validate(item.model_dump())


class ResponseStore:
    """Entries by owner and response id. Every method runs on the event loop, so none
    interleave; `put` and `get` count as uses (the entry becomes the last to evict)."""

    def __init__(self, limits: StoreLimits | None = None) -> None:
        self.limits = limits or DEFAULT_LIMITS
        self._owners: dict[str | None, _OwnerEntries] = {}

    def put(
        self, owner: str | None, response: dict[str, Any], previous: StoredResponse | None,
        new_items: Sequence[InputItem],
    ) -> StoredResponse | None:
        """Store `response`, whose conversation is `previous`'s (if it continued from one)
        and then `new_items` (its input, then its output). Evicts the least recently used
        entries to stay within the limits; None if the entry alone is over `max_bytes`."""
        history = previous.conversation if previous else ()
        history_bytes = previous.conversation_bytes if previous else 0
        added = sum(len(item.model_dump_json(exclude_none=True)) for item in new_items)
        conversation_bytes = history_bytes + added
        size = conversation_bytes + len(json.dumps(response, separators=(",", ":")))
        entry = StoredResponse(response, (*history, *new_items), conversation_bytes, size)
        if entry.size > self.limits.max_bytes:
            return None
        self._owners.setdefault(owner, _OwnerEntries()).add(entry, self.limits)
        return entry

    def get(self, owner: str | None, response_id: str) -> StoredResponse | None:
        entries = self._owners.get(owner)
        return entries.get(response_id) if entries else None

    def delete(self, owner: str | None, response_id: str) -> bool:
        entries = self._owners.get(owner)
        return entries.delete(response_id) if entries else False


class _OwnerEntries:
    """One owner's entries, least recently used first, and their total size."""

    def __init__(self) -> None:
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.size = 0

    def add(self, entry: StoredResponse, limits: StoreLimits) -> None:
        self.delete(entry.response["id"])
        while self._entries and (
            len(self._entries) >= limits.max_responses
            or self.size + entry.size > limits.max_bytes
        ):
            _, evicted = self._entries.popitem(last=False)
            self.size -= evicted.size
        self._entries[entry.response["id"]] = entry
        self.size += entry.size

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.size -= entry.size
        return entry is not None
