"""The Responses store on its own: owners kept apart, conversations carried through follow-ups,
and both bounds evicting the least recently used entry."""

from __future__ import annotations

import json

import pytest

from server.responses.protocol import InputItem, OutputMessage, OutputText
from server.responses.store import ResponseStore, StoreLimits, as_input


def user(text: str) -> InputItem:
    return InputItem(type="message", role="user", content=text)


def response(response_id: str, padding: str = "") -> dict:
    return {"id": response_id, "object": "response", "metadata": {"pad": padding}}


def put(store: ResponseStore, response_id: str, owner: str | None = None, previous=None,
        padding: str = ""):
    return store.put(owner, response(response_id, padding), previous, [user(response_id)])


def test_a_follow_up_carries_the_whole_conversation_after_its_parent_is_gone():
    store = ResponseStore()
    answer = OutputMessage(id="msg_1", status="completed", content=[OutputText(text="Paris.")])
    first = store.put(None, response("resp_1"), None, [user("Capital of France?"),
                                                       as_input(answer)])
    second = store.put(None, response("resp_2"), first, [user("And of Spain?")])
    assert store.delete(None, "resp_1") and store.get(None, "resp_1") is None
    stored = store.get(None, "resp_2")
    assert stored is second and stored.response == response("resp_2")
    assert [item.model_dump(exclude_none=True) for item in stored.conversation] == [
        {"type": "message", "role": "user", "content": "Capital of France?"},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Paris."}]},
        {"type": "message", "role": "user", "content": "And of Spain?"},
    ]  # fmt: skip
    assert stored.conversation_bytes > first.conversation_bytes


def test_an_output_message_comes_back_as_an_assistant_input_item():
    answer = OutputMessage(id="msg_1", status="completed", content=[OutputText(text="Paris.")])
    item = as_input(answer)
    assert (item.type, item.role) == ("message", "assistant")
    assert [(part.type, part.text) for part in item.content] == [("output_text", "Paris.")]


def test_owners_see_and_delete_only_their_own():
    store = ResponseStore()
    put(store, "resp_a", owner="tenant-a")
    put(store, "resp_none")  # without keys
    assert store.get("tenant-b", "resp_a") is None and store.get(None, "resp_a") is None
    assert not store.delete("tenant-b", "resp_a")
    assert store.get("tenant-a", "resp_none") is None
    assert store.get("tenant-a", "resp_a") is not None


def test_the_count_bound_evicts_the_least_recently_used():
    store = ResponseStore(StoreLimits(max_responses=2))
    for response_id in ("resp_1", "resp_2", "resp_3"):
        put(store, response_id)
    assert store.get(None, "resp_1") is None
    assert store.get(None, "resp_2") is not None  # used: now resp_3 is the oldest
    put(store, "resp_4")
    assert [store.get(None, f"resp_{n}") is not None for n in (2, 3, 4)] == [True, False, True]
    put(store, "resp_5", owner="other")  # another owner's entries count against its own bound
    assert store.get(None, "resp_4") is not None


def test_the_byte_bound_evicts_and_an_entry_over_it_is_not_kept():
    one = put(ResponseStore(), "resp_1", padding="x" * 1000)
    store = ResponseStore(StoreLimits(max_bytes=2 * one.size + 10))
    for response_id in ("resp_1", "resp_2", "resp_3"):
        put(store, response_id, padding="x" * 1000)
    assert [store.get(None, f"resp_{n}") is not None for n in (1, 2, 3)] == [False, True, True]
    assert put(store, "resp_big", padding="x" * 3000) is None
    assert store.get(None, "resp_big") is None and store.get(None, "resp_3") is not None
    expected = len(json.dumps(response("resp_1", "x" * 1000), separators=(",", ":")))
    assert one.size == expected + len(user("resp_1").model_dump_json(exclude_none=True))


def test_limits_must_be_positive():
    with pytest.raises(ValueError, match="max_responses=0"):
        StoreLimits(max_responses=0)
