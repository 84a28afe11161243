"""The Anthropic message builder on turn events: the wire events it sends, the message the
official client rebuilds from them, and the builder's own whole message, for calls the turn
ended inside."""

from __future__ import annotations

import json

import pytest
from anthropic.lib.streaming._messages import accumulate_event

from server.anthropic.output import MessageBuilder
from server.core.chat_request import Usage
from server.core.turn_events import (
    TextDelta,
    ToolCallArguments,
    ToolCallEnd,
    ToolCallStart,
    Turn,
    TurnEnd,
)


def built_stream(*events) -> tuple[list[dict], object, object]:
    """(wire events, the message the official client rebuilds from them, the builder's)."""
    turn = Turn(prompt_tokens=5, cached_tokens=0, events=None, choices=None)
    builder = MessageBuilder("msg_1", "m", turn)
    wire = builder.start()
    for event in events:
        wire += builder.add(event)
    snapshot, buffers = None, {}
    for event in json.loads(json.dumps(wire)):
        snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=buffers)
    return wire, snapshot, builder.result()


CUT = TurnEnd("length", None, Usage.of(5, 9, 0))
WRITE_START = '{"file_path": "/tmp/a.txt", "content": "hel'


@pytest.mark.parametrize(
    ("fragments", "cut_input"),
    [
        ([WRITE_START], {"file_path": "/tmp/a.txt", "content": "hel"}),
        ([WRITE_START[:10], WRITE_START[10:]], {"file_path": "/tmp/a.txt", "content": "hel"}),
        ([], {}),
        (['{"file_pa'], {}),
    ],
)
def test_a_turn_cut_inside_a_tool_call_ends_well_formed(fragments, cut_input):
    """max_tokens inside a call: the tool_use block is closed with what its partial JSON
    holds, and the stop reason says the turn was cut, not that a call is ready to run."""
    cut = ToolCallEnd("Write", "".join(fragments), complete=False)
    events = [TextDelta("Writing. "), ToolCallStart("Write"),
              *map(ToolCallArguments, fragments), cut, CUT]  # fmt: skip
    wire, rebuilt, whole = built_stream(*events)
    kinds = [event["type"] for event in wire]
    starts = [e["index"] for e in wire if e["type"] == "content_block_start"]
    stops = [e["index"] for e in wire if e["type"] == "content_block_stop"]
    assert starts == stops == [0, 1]
    assert kinds[-2:] == ["message_delta", "message_stop"]
    assert whole.stop_reason == rebuilt.stop_reason == "max_tokens"
    assert whole.content[1].input == cut_input
    assert rebuilt.content[1].name == "Write"


def test_a_call_cut_by_the_end_of_the_turn_is_not_a_tool_use():
    """The model stopped (EOS) inside a call: the block closes, the turn is no tool_use."""
    events = [ToolCallStart("get_weather"), ToolCallArguments('{"city": "Par'),
              ToolCallEnd("get_weather", '{"city": "Par', complete=False),
              TurnEnd("stop", None, Usage.of(5, 3, 0))]  # fmt: skip
    _, rebuilt, whole = built_stream(*events)
    assert whole.stop_reason == rebuilt.stop_reason == "end_turn"
    assert whole.content[0].input == {"city": "Par"}


def test_a_whole_call_then_max_tokens_is_still_a_tool_use():
    arguments = '{"city": "Paris"}'
    events = [ToolCallStart("get_weather"), ToolCallArguments(arguments),
              ToolCallEnd("get_weather", arguments), CUT]  # fmt: skip
    _, rebuilt, whole = built_stream(*events)
    assert whole.stop_reason == rebuilt.stop_reason == "tool_use"
    assert whole.content[0].input == rebuilt.content[0].input == {"city": "Paris"}
