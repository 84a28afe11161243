"""The OpenAI Responses API, driven by the official `openai` client (its stream helper rebuilds
the response from the events, and fails on events out of order or items that change identity):
on the default model, and on a scripted model that fixes what the model says."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from fake_engine import (
    TEXT_THEN_HERMES_CALL,
    FailingEngine,
    ScriptedEngine,
    SlowEngine,
    ToolTemplateTokenizer,
    wait_until_aborted,
)
from server_helpers import running_server, small_engine

MAX_MODEL_LEN = 512
QUESTION = "What is the capital of France?"
WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
CHAT_WEATHER_TOOL = {
    "type": "function",
    "function": {key: value for key, value in WEATHER_TOOL.items() if key != "type"},
}
WEATHER_QUESTION = "What is the weather in Paris right now?"
MESSAGE_EVENTS = (
    "response.output_item.added response.content_part.added( response.output_text.delta)+ "
    "response.output_text.done response.content_part.done response.output_item.done"
)
CALL_EVENTS = (
    "response.output_item.added( response.function_call_arguments.delta)+ "
    "response.function_call_arguments.done response.output_item.done"
)


@pytest.fixture(scope="module")
def engine(default_model_dir):
    return small_engine(default_model_dir, MAX_MODEL_LEN)


def greedy(**fields) -> dict:
    return {"model": "default", "max_output_tokens": 24, "temperature": 0, **fields}


def raw_events(client: openai.OpenAI, **fields) -> list:
    return list(client.responses.create(stream=True, **greedy(**fields)))


def streamed_response(client: openai.OpenAI, **fields):
    with client.responses.stream(**greedy(**fields)) as stream:
        return stream.get_final_response()


@pytest.mark.slow
def test_text_matches_chat_completions(client):
    instructions = "Answer in one sentence."
    response = client.responses.create(**greedy(input=QUESTION, instructions=instructions))
    messages = [{"role": "system", "content": instructions}, {"role": "user", "content": QUESTION}]
    reply = client.chat.completions.create(
        model="default", messages=messages, temperature=0, max_tokens=24
    )
    assert response.object == "response" and response.id.startswith("resp_")
    assert (
        response.status
        == {"stop": "completed", "length": "incomplete"}[reply.choices[0].finish_reason]
    )
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"
    assert response.output_text == reply.choices[0].message.content
    assert response.usage.input_tokens == reply.usage.prompt_tokens
    assert response.usage.output_tokens == reply.usage.completion_tokens
    assert response.instructions == instructions


@pytest.mark.slow
def test_stream_events_come_in_order(client):
    whole = client.responses.create(**greedy(input=QUESTION, max_output_tokens=64))
    events = raw_events(client, input=QUESTION, max_output_tokens=64)
    kinds = " ".join(event.type for event in events)
    assert re.fullmatch(
        f"response.created response.in_progress {MESSAGE_EVENTS} response.completed", kinds
    ), kinds
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    deltas = [event for event in events if event.type == "response.output_text.delta"]
    assert "".join(event.delta for event in deltas) == whole.output_text
    item_id = events[2].item.id
    assert all(event.item_id == item_id for event in deltas)
    final = events[-1].response
    assert final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert streamed_response(client, input=QUESTION, max_output_tokens=64).output_text == (
        whole.output_text
    )


@pytest.mark.slow
def test_max_output_tokens_makes_the_response_incomplete(client):
    response = client.responses.create(
        **greedy(input="Write a long story about a dragon.", max_output_tokens=5)
    )
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 5
    assert response.output[0].status == "incomplete"
    events = raw_events(client, input="Write a long story about a dragon.", max_output_tokens=5)
    assert events[-1].type == "response.incomplete"


@pytest.mark.slow
def test_function_call_round_trip(client):
    first = client.responses.create(**greedy(
        input=WEATHER_QUESTION, tools=[WEATHER_TOOL], tool_choice="required",
        max_output_tokens=64,
    ))  # fmt: skip
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert isinstance(json.loads(call.arguments)["city"], str)
    assert call.call_id.startswith("call_")

    conversation = [
        {"role": "user", "content": WEATHER_QUESTION},
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "18 C and sunny"},
    ]
    answer = client.responses.create(**greedy(
        input=conversation, tools=[WEATHER_TOOL], tool_choice="none", max_output_tokens=32,
    ))  # fmt: skip
    assert [item.type for item in answer.output] == ["message"]
    assert answer.output_text.strip()
    # The same conversation through chat completions: the same prompt and answer.
    function = {"name": call.name, "arguments": call.arguments}
    chat_call = {"id": call.call_id, "type": "function", "function": function}
    messages = [
        {"role": "user", "content": WEATHER_QUESTION},
        {"role": "assistant", "content": None, "tool_calls": [chat_call]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "18 C and sunny"},
    ]
    reply = client.chat.completions.create(
        model="default", messages=messages, temperature=0, max_tokens=32, tool_choice="none",
        tools=[CHAT_WEATHER_TOOL],
    )  # fmt: skip
    assert answer.usage.input_tokens == reply.usage.prompt_tokens
    assert answer.output_text == reply.choices[0].message.content


@pytest.mark.slow
def test_streamed_function_call_matches_whole(client):
    fields = dict(
        input=WEATHER_QUESTION, tools=[WEATHER_TOOL], max_output_tokens=64,
        tool_choice={"type": "function", "name": "get_weather"},
    )  # fmt: skip
    whole = client.responses.create(**greedy(**fields))
    events = raw_events(client, **fields)
    kinds = " ".join(event.type for event in events)
    assert re.fullmatch(
        f"response.created response.in_progress {CALL_EVENTS} response.completed", kinds
    ), kinds
    added, *deltas, done = events[2:-2]
    assert added.item.type == "function_call" and added.item.arguments == ""
    assert "".join(delta.delta for delta in deltas) == done.arguments == whole.output[0].arguments
    assert json.loads(done.arguments) == json.loads(whole.output[0].arguments)
    [call] = streamed_response(client, **fields).output
    assert call.arguments == whole.output[0].arguments


@pytest.mark.slow
def test_json_schema_output_validates(client):
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 24},
            "country": {"type": "string", "maxLength": 24},
            "population": {"type": "integer", "minimum": 0, "maximum": 100_000_000},
        },
        "required": ["city", "country", "population"],
        "additionalProperties": False,
    }
    text_format = {"type": "json_schema", "name": "city", "schema": schema, "strict": True}
    response = client.responses.create(**greedy(
        input="Describe Paris as JSON.", text={"format": text_format}, max_output_tokens=200,
    ))  # fmt: skip
    assert response.status == "completed", response.output_text
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text.format.type == "json_schema"


# ---- scripted model text: what the translation sends and how the answer is built ------------

SCRIPT = TEXT_THEN_HERMES_CALL
SCRIPTED_MAX_MODEL_LEN = ScriptedEngine.max_model_len


@pytest.fixture(scope="module")
def scripted():
    """(client, engine, url) of a server whose model always says SCRIPT, with a Hermes
    template."""
    engine = ScriptedEngine(SCRIPT, ToolTemplateTokenizer())
    with running_server(engine) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0), engine, url


def test_message_then_function_call_items(scripted):
    client, _, _ = scripted
    fields = dict(model="m", input=WEATHER_QUESTION, tools=[WEATHER_TOOL])
    response = client.responses.create(**fields)
    assert [item.type for item in response.output] == ["message", "function_call"]
    assert response.output_text == "Let me check. "
    call = response.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert response.status == "completed"

    events = list(client.responses.create(stream=True, **fields))
    kinds = " ".join(event.type for event in events)
    assert re.fullmatch(
        f"response.created response.in_progress {MESSAGE_EVENTS} {CALL_EVENTS} response.completed",
        kinds,
    ), kinds
    assert [e.output_index for e in events if e.type == "response.output_item.added"] == [0, 1]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    with client.responses.stream(**fields) as stream:
        rebuilt = stream.get_final_response()
    assert rebuilt.output_text == "Let me check. "
    assert json.loads(rebuilt.output[1].arguments) == {"city": "Paris"}


def test_input_items_reach_the_template_as_chat_messages(scripted):
    client, engine, _ = scripted
    items = [
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "Weather "},
                     {"type": "input_text", "text": "in Paris?"}]},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Let me check."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "18 C"},
    ]  # fmt: skip
    response = client.responses.create(
        model="m", instructions="Be brief.", input=items, tools=[WEATHER_TOOL]
    )
    prompt = list(engine.prompts.values())[-1]
    tools_line, *turns, _ = prompt.split("\n")  # one JSON line per message
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}  # fmt: skip
    assert [json.loads(turn) for turn in turns] == [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [call]},
        {"role": "tool", "content": "18 C", "tool_call_id": "call_1"},
    ]
    [tool] = json.loads(tools_line.removeprefix("tools: "))
    assert tool["function"]["parameters"] == WEATHER_TOOL["parameters"]
    assert response.usage.input_tokens == len(prompt)  # one token per character


def test_reasoning_comes_as_a_reasoning_item():
    script = ["<think>", "Paris is in ", "France.", "</think>", "\nParis."]
    engine = ScriptedEngine(script)
    with running_server(engine) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        response = client.responses.create(model="m", input=QUESTION)
        events = list(client.responses.create(model="m", input=QUESTION, stream=True))
        follow_up = [{"role": "user", "content": QUESTION},
                     *[item.model_dump(exclude_none=True) for item in response.output],
                     {"role": "user", "content": "And of Spain?"}]  # fmt: skip
        client.responses.create(model="m", input=follow_up)
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == "Paris is in France."
    assert response.output_text == "\nParis."
    kinds = " ".join(event.type for event in events)
    reasoning_events = MESSAGE_EVENTS.replace("output_text", "reasoning_text")
    assert re.fullmatch(
        f"response.created response.in_progress {reasoning_events} {MESSAGE_EVENTS} "
        "response.completed",
        kinds,
    ), kinds
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == "Paris is in France."
    # Sent back, the reasoning stays out of the next prompt; the answer goes in.
    prompt = list(engine.prompts.values())[-1]
    assert "Paris is in France." not in prompt and "assistant: \nParis.\n" in prompt


# (fields, the error's param): requests that must get a 400.
BAD_REQUESTS = [
    ({"input": []}, "input"),
    ({"previous_response_id": "resp_123"}, "previous_response_id"),  # not stored
    ({"background": True}, "background"),
    ({"conversation": "conv_123"}, "conversation"),
    ({"prompt": {"id": "pmpt_123"}}, "prompt"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].image_url"),  # the model has no vision
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}]},
     "input[0].content[0].file_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file-1"}]}]},
     "input[0]"),
    ({"input": [{"type": "function_call", "name": "get_weather"}]}, "input[0]"),
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice"),
    ({"tools": [{"type": "hologram"}]}, "tools[0].type"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "word " * SCRIPTED_MAX_MODEL_LEN}, "input"),
]  # fmt: skip


def test_bad_requests_get_openai_errors(scripted):
    _, engine, url = scripted
    prompts_before = len(engine.prompts)
    for fields, param in BAD_REQUESTS:
        body = {"model": "m", "input": QUESTION, **fields}
        response = httpx.post(f"{url}/v1/responses", json=body)
        assert response.status_code == 400, (fields, response.text)
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "invalid_request_error"
        assert error["param"] == param, error
    assert len(engine.prompts) == prompts_before  # none reached the engine


def test_stateful_requests_are_refused_by_the_client_too(scripted):
    client, _, _ = scripted
    with pytest.raises(openai.BadRequestError) as raised:
        client.responses.create(model="m", input=QUESTION, conversation="conv_1")
    assert "conversation" in raised.value.message


def test_an_engine_failure_fails_the_response():
    body = {"model": "m", "input": QUESTION}
    with running_server(FailingEngine(["Hello", " there"])) as url:
        whole = httpx.post(f"{url}/v1/responses", json=body)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        events = list(client.responses.create(stream=True, **body))
    assert whole.status_code == 500 and whole.json()["error"]["type"] == "server_error"
    assert [event.type for event in events][-2:] == [
        "response.output_text.delta",
        "response.failed",
    ]
    failed = events[-1].response
    assert failed.status == "failed" and failed.error.code == "server_error"
    # Generic: the engine's own text may hold a prompt (docs/hardening.md, Errors).
    assert failed.error.message.startswith("The engine failed")
    assert "the device fell over" not in failed.error.message


def test_a_client_that_leaves_aborts_its_request():
    engine = SlowEngine(["word "] * 1000)  # 10 s of output
    body = {"model": "m", "input": QUESTION}
    with running_server(engine) as url:
        with httpx.stream("POST", f"{url}/v1/responses", json={**body, "stream": True}) as r:
            next(line for line in r.iter_lines() if line == "event: response.output_text.delta")
        wait_until_aborted(engine, 1)
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{url}/v1/responses", json=body, timeout=0.5)
        wait_until_aborted(engine, 2)
