"""Build a Responses `Response` from a turn's events, and the stream events that tell it.

A non-streaming answer is the builder's response once every turn event went in; a stream
sends the events as they come. Both see the same output items. Every event carries the
next `sequence_number`:

    response.created  response.in_progress
    per reasoning / message item (X = reasoning_text / output_text):
        output_item.added  content_part.added  X.delta*  X.done  content_part.done
        output_item.done
    per function call (Y = function_call_arguments) / custom tool call (Y = custom_tool_call_input):
        output_item.added  Y.delta*  Y.done  output_item.done
    response.completed | response.incomplete (max_output_tokens) | response.failed

Calls are named as the client named the tool (a namespace's tool by its own name and the
`namespace`); a custom tool's call carries the `input` decoded from the model's arguments.
A call still open when the turn ends is closed as `incomplete`.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Callable
from typing import Any

from server.core.turn_events import (
    ReasoningDelta,
    TextDelta,
    ToolCallArguments,
    ToolCallEnd,
    ToolCallStart,
    TurnEnd,
    TurnEvent,
)
from server.core.turn_http import Event
from server.responses.custom_input import InputStream, input_of
from server.responses.protocol import (
    CustomToolCall,
    FunctionCall,
    IncompleteDetails,
    ItemStatus,
    OutputItem,
    OutputMessage,
    OutputText,
    ReasoningItem,
    ReasoningText,
    ResponseObject,
    ResponseUsage,
)
from server.responses.tools import ToolSet

TextItem = ReasoningItem | OutputMessage  # the items whose one part grows by deltas
CallItem = FunctionCall | CustomToolCall


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _new_text_item(kind: type[TextItem]) -> TextItem:
    """An item of `kind` in progress, with its one part still empty."""
    if kind is ReasoningItem:
        return ReasoningItem(id=_new_id("rs"), status="in_progress", content=[ReasoningText()])
    return OutputMessage(id=_new_id("msg"), status="in_progress", content=[OutputText()])


def _new_call(name: str, tools: ToolSet) -> CallItem:
    """The item of a call the model began by `name` (the name it was offered the tool by)."""
    tool = tools.called(name)
    ids = {"id": _new_id("fc"), "call_id": _new_id("call"), "status": "in_progress"}
    if tool is None:  # a name the request did not offer: passed on as the model wrote it
        return FunctionCall(name=name, arguments="", **ids)
    if tool.kind == "custom":
        ids["id"] = _new_id("ctc")
        return CustomToolCall(name=tool.name, namespace=tool.namespace, input="", **ids)
    return FunctionCall(name=tool.name, namespace=tool.namespace, arguments="", **ids)


class ResponseBuilder:
    def __init__(
        self, response: ResponseObject, tools: ToolSet,
        on_end: Callable[[ResponseObject], None] | None = None,
    ) -> None:
        self.response = response  # status "in_progress", no output yet
        self._tools = tools
        # Called with the response once it is completed or incomplete (not failed), before
        # the event that says so: a client that saw it end finds it stored.
        self._on_end = on_end
        self._sequence = itertools.count()
        self._open_item: TextItem | None = None  # the item taking text deltas
        self._open_call: CallItem | None = None  # the call taking argument fragments
        self._input = InputStream()  # a custom tool call's input, decoded from them

    def start(self) -> list[Event]:
        return [
            self._response_event("response.created"),
            self._response_event("response.in_progress"),
        ]

    def add(self, event: TurnEvent) -> list[Event]:
        if isinstance(event, ReasoningDelta):
            return self._text(ReasoningItem, event.text)
        if isinstance(event, TextDelta):
            return self._text(OutputMessage, event.text)
        if isinstance(event, ToolCallStart):
            return self._open_function_call(event.name)
        if isinstance(event, ToolCallArguments):
            return self._function_call_arguments(event.text)
        if isinstance(event, ToolCallEnd):
            return self._close_function_call(event)
        return self._end(event)

    def fail(self, message: str) -> list[Event]:
        """The engine failed after the stream began."""
        self.response.status = "failed"
        self.response.error = {"code": "server_error", "message": message}
        return [self._response_event("response.failed")]

    def result(self) -> ResponseObject:
        return self.response

    def _text(self, kind: type[TextItem], text: str) -> list[Event]:
        events = []
        if not isinstance(self._open_item, kind):
            events = self._close_text_item("completed") + self._open_text_item(kind)
        assert self._open_item is not None
        self._open_item.content[0].text += text
        delta = self._text_event("delta", content_index=0, delta=text)
        return [*events, delta]

    def _open_function_call(self, name: str) -> list[Event]:
        events = self._close_text_item("completed")
        self._open_call = _new_call(name, self._tools)
        self._input = InputStream()
        return [*events, self._add_item(self._open_call)]

    def _function_call_arguments(self, text: str) -> list[Event]:
        item = self._open_call
        assert item is not None
        if isinstance(item, FunctionCall):
            item.arguments += text
            return [self._item_event("response.function_call_arguments.delta", delta=text)]
        return self._input_delta(item, self._input.feed(text))

    def _input_delta(self, item: CustomToolCall, text: str) -> list[Event]:
        if not text:
            return []
        item.input += text
        return [self._item_event("response.custom_tool_call_input.delta", delta=text)]

    def _close_function_call(self, call: ToolCallEnd) -> list[Event]:
        """Close the open call: `completed`, or `incomplete` when it is no call to run."""
        item = self._open_call
        assert item is not None
        self._open_call = None
        item.status = "completed" if call.complete else "incomplete"
        if isinstance(item, FunctionCall):
            item.arguments = call.arguments
            fields = {"name": item.name, "arguments": item.arguments}
            done = self._item_event("response.function_call_arguments.done", **fields)
            return [done, self._item_done()]
        events = self._rest_of_input(item, call.arguments) if call.complete else []
        done = self._item_event("response.custom_tool_call_input.done", input=item.input)
        return [*events, done, self._item_done()]

    def _rest_of_input(self, item: CustomToolCall, arguments: str) -> list[Event]:
        """The input that did not stream yet, from the call's whole arguments (all of it when
        they are not `{"input": ...}`, which the stream cannot decode)."""
        whole = input_of(arguments)
        rest = whole[len(item.input) :] if whole.startswith(item.input) else ""
        events = self._input_delta(item, rest)
        item.input = whole
        return events

    def _end(self, end: TurnEnd) -> list[Event]:
        truncated = end.finish_reason == "length"
        events = self._close_text_item("incomplete" if truncated else "completed")
        if not self.response.output:  # clients read output[0]: "nothing" is an empty message
            events += self._open_text_item(OutputMessage) + self._close_text_item("completed")
        usage = end.usage
        self.response.usage = ResponseUsage.of(
            usage.prompt_tokens, usage.completion_tokens, usage.prompt_tokens_details.cached_tokens
        )
        self.response.completed_at = int(time.time())
        if truncated:
            self.response.status = "incomplete"
            self.response.incomplete_details = IncompleteDetails(reason="max_output_tokens")
        else:
            self.response.status = "completed"
        if self._on_end is not None:
            self._on_end(self.response)
        return [*events, self._response_event(f"response.{self.response.status}")]

    def _open_text_item(self, kind: type[TextItem]) -> list[Event]:
        item = self._open_item = _new_text_item(kind)
        # Announced without its part, which comes in the next event.
        added = self._add_item(item, item.model_copy(update={"content": []}))
        part = item.content[0].model_dump()
        return [added, self._item_event("response.content_part.added", content_index=0, part=part)]

    def _close_text_item(self, status: ItemStatus) -> list[Event]:
        if self._open_item is None:
            return []
        self._open_item.status = status
        part = self._open_item.content[0]
        events = [
            self._text_event("done", content_index=0, text=part.text),
            self._item_event("response.content_part.done", content_index=0, part=part.model_dump()),
            self._item_done(),
        ]
        self._open_item = None
        return events

    def _text_event(self, stage: str, **fields: Any) -> Event:
        """`response.output_text.*` (with its logprobs) or `response.reasoning_text.*`."""
        if isinstance(self._open_item, OutputMessage):
            return self._item_event(f"response.output_text.{stage}", **fields, logprobs=[])
        return self._item_event(f"response.reasoning_text.{stage}", **fields)

    def _add_item(self, item: OutputItem, announced: OutputItem | None = None) -> Event:
        self.response.output.append(item)
        shown = (announced or item).model_dump()
        return self._event("response.output_item.added", output_index=self._index, item=shown)

    def _item_done(self) -> Event:
        item = self.response.output[-1].model_dump()
        return self._event("response.output_item.done", output_index=self._index, item=item)

    def _item_event(self, kind: str, **fields: Any) -> Event:
        item_id = self.response.output[-1].id
        return self._event(kind, item_id=item_id, output_index=self._index, **fields)

    def _response_event(self, kind: str) -> Event:
        return self._event(kind, response=self.response.model_dump())

    def _event(self, kind: str, **fields: Any) -> Event:
        return {"type": kind, "sequence_number": next(self._sequence), **fields}

    @property
    def _index(self) -> int:
        return len(self.response.output) - 1
