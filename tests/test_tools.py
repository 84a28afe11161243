"""Tool calls through the chat API: scripted model text without a model, then a round trip
on the default model with the official client."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from fake_engine import ScriptedEngine, ToolTemplateTokenizer
from fastapi.testclient import TestClient
from server_helpers import running_server, small_engine

from server.app import build_app
from server.async_engine import AsyncEngine
from server.openai.serving import Serving

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": WEATHER_PARAMETERS,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The local time in a time zone.",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"type": "string"}},
                "required": ["zone"],
            },
        },
    },
]
WEATHER_CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
TIME_CALL = '{"name": "get_time", "arguments": {"zone": "CET"}}'
# Two Hermes calls after some text, cut at awkward places (inside the marker, the JSON).
HERMES_SCRIPT = [
    "I'll check.", "<to", "ol_call>", WEATHER_CALL[:20], WEATHER_CALL[20:], "</tool_",
    "call>\n<tool_call>", TIME_CALL, "</tool_call>",
]  # fmt: skip


def scripted_client(script: list[str], tokenizer=None) -> tuple[TestClient, ScriptedEngine]:
    engine = ScriptedEngine(script, tokenizer)
    return TestClient(build_app(AsyncEngine(engine), "default")), engine


def chat(**fields) -> dict:
    messages = [{"role": "user", "content": "Weather and time in Paris?"}]
    return {"model": "m", "messages": messages, "tools": TOOLS, **fields}


def sse_chunks(response) -> list[dict]:
    events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


# ---- scripted model text --------------------------------------------------------------------


def test_parallel_hermes_calls_in_a_whole_response():
    client, engine = scripted_client(HERMES_SCRIPT)
    with client:
        choice = client.post("/v1/chat/completions", json=chat()).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "I'll check."
    calls = choice["message"]["tool_calls"]
    assert [(c["type"], c["function"]["name"]) for c in calls] == [
        ("function", "get_weather"),
        ("function", "get_time"),
    ]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "unit": "celsius"}
    assert len({c["id"] for c in calls}) == 2
    # The template has no tool syntax: the tools were described in a system message.
    (prompt,) = engine.prompts.values()
    assert prompt.startswith("system: You can call these functions:") and "get_time" in prompt


def test_streamed_calls_come_as_tool_call_deltas_never_as_content():
    client, _ = scripted_client(HERMES_SCRIPT)
    with client, client.stream("POST", "/v1/chat/completions", json=chat(stream=True)) as r:
        chunks = sse_chunks(r)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("content", "") for d in deltas) == "I'll check."
    calls = [call for d in deltas for call in d.get("tool_calls", [])]
    assert [(c["index"], c["function"]["name"]) for c in calls] == [
        (0, "get_weather"),
        (1, "get_time"),
    ]
    assert json.loads(calls[1]["function"]["arguments"]) == {"zone": "CET"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_a_long_argument_streams_in_many_deltas_that_join_to_the_call():
    content = "".join(f"line {i}: print({i})\n" for i in range(60))
    call = json.dumps({"name": "get_time", "arguments": {"zone": content}})
    script = ["<tool_call>", *(call[i : i + 3] for i in range(0, len(call), 3)), "</tool_call>"]
    engine = ScriptedEngine(script, ToolTemplateTokenizer())
    with running_server(engine) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        stream = client.chat.completions.create(
            model="default", messages=chat()["messages"], tools=TOOLS, stream=True
        )
        deltas = [d for c in stream if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert (deltas[0].function.name, deltas[0].type) == ("get_time", "function")
    assert deltas[0].id and all(d.id is None and d.index == 0 for d in deltas[1:])
    fragments = [d.function.arguments for d in deltas if d.function.arguments]
    assert len(fragments) > 50
    assert json.loads("".join(fragments)) == {"zone": content}


def test_without_parallel_calls_only_the_first_is_returned():
    client, _ = scripted_client(HERMES_SCRIPT)
    with client:
        body = chat(parallel_tool_calls=False)
        message = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]


def test_tool_choice_none_leaves_the_text_alone():
    client, engine = scripted_client(HERMES_SCRIPT)
    with client:
        choice = client.post("/v1/chat/completions", json=chat(tool_choice="none")).json()
    message = choice["choices"][0]["message"]
    assert message["content"] == "".join(HERMES_SCRIPT) and "tool_calls" not in message
    assert "You can call" not in next(iter(engine.prompts.values()))


def test_required_and_named_choices_generate_under_the_call_schema():
    client, engine = scripted_client([WEATHER_CALL[:30], WEATHER_CALL[30:]])
    with client:
        named = {"type": "function", "function": {"name": "get_weather"}}
        replies = [
            client.post("/v1/chat/completions", json=chat(tool_choice=choice)).json()
            for choice in ("required", named)
        ]
    required_params, named_params = engine.params.values()
    required_schema = json.loads(required_params.structured.json_schema)
    assert [s["properties"]["name"]["enum"] for s in required_schema["anyOf"]] == [
        ["get_weather"],
        ["get_time"],
    ]
    named_schema = json.loads(named_params.structured.json_schema)
    assert named_schema["properties"]["arguments"] == WEATHER_PARAMETERS
    jsonschema.validate(json.loads(WEATHER_CALL), named_schema)
    for reply in replies:
        choice = reply["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"


def test_tool_history_is_rendered_as_text_for_a_template_without_tool_syntax():
    client, engine = scripted_client(["It is sunny."])
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C, sunny"},
    ]
    with client:
        reply = client.post("/v1/chat/completions", json=chat(messages=messages)).json()
    assert reply["choices"][0]["message"] == {"role": "assistant", "content": "It is sunny."}
    prompt = next(iter(engine.prompts.values()))
    block = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    assert f"assistant: {block}\n" in prompt
    assert "user: Result of the call to call_1:\n18C, sunny" in prompt


def test_a_template_with_tool_syntax_gets_tools_and_tool_messages_as_they_are():
    client, engine = scripted_client(HERMES_SCRIPT[1:], ToolTemplateTokenizer())
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_time", "arguments": '{"zone": "CET"}'},
    }
    messages = [
        {"role": "user", "content": "Time?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    ]
    with client:
        reply = client.post("/v1/chat/completions", json=chat(messages=messages)).json()
    assert len(reply["choices"][0]["message"]["tool_calls"]) == 2
    tools_line, *turns = next(iter(engine.prompts.values())).split("\n")[:4]
    assert json.loads(tools_line.removeprefix("tools: ")) == TOOLS
    assert json.loads(turns[1])["tool_calls"][0]["function"]["arguments"] == {"zone": "CET"}
    assert json.loads(turns[2]) == {"role": "tool", "content": "12:00", "tool_call_id": "call_1"}


def test_reasoning_is_separated_whole_and_streamed():
    client, _ = scripted_client(["<thi", "nk>Paris is in", " France.</th", "ink>\nParis."])
    body = {"messages": [{"role": "user", "content": "Capital?"}]}
    with client:
        message = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
        with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            deltas = [c["choices"][0]["delta"] for c in sse_chunks(r)]
    assert message["reasoning_content"] == "Paris is in France."
    assert message["content"] == "\nParis."
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Paris is in France."
    assert "".join(d.get("content", "") for d in deltas) == "\nParis."


def test_an_unknown_tool_call_parser_is_refused_at_start():
    with pytest.raises(ValueError, match="llama3_json"):
        Serving(AsyncEngine(ScriptedEngine([])), "default", max_n=1, tool_call_parser="nope")


# ---- the default model ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(default_model_dir):
    with running_server(small_engine(default_model_dir, 1024)) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)


def weather_question() -> list[dict]:
    return [{"role": "user", "content": "What is the weather like in Paris today?"}]


def answer_with_the_result(client, messages: list[dict], call) -> None:
    """Send the call's result back; the model must answer in text."""
    messages = [
        *messages,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees celsius and sunny"},
    ]
    reply = client.chat.completions.create(
        model="default", messages=messages, tools=TOOLS, tool_choice="none", temperature=0,
        max_tokens=40,
    )  # fmt: skip
    choice = reply.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.message.tool_calls is None
    assert choice.message.content.strip()


@pytest.mark.slow
def test_required_tool_call_round_trip(client):
    messages = weather_question()
    reply = client.chat.completions.create(
        model="default", messages=messages, tools=TOOLS, tool_choice="required", temperature=0,
        max_tokens=100,
    )  # fmt: skip
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    schema = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
    jsonschema.validate(json.loads(call.function.arguments), schema[call.function.name])
    answer_with_the_result(client, messages, call)


@pytest.mark.slow
def test_named_tool_call_round_trip_streamed(client):
    messages = weather_question()
    stream = client.chat.completions.create(
        model="default", messages=messages, tools=TOOLS, temperature=0, max_tokens=100,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, stream=True,
    )  # fmt: skip
    chunks = [chunk for chunk in stream if chunk.choices]
    assert all(not c.choices[0].delta.content for c in chunks)
    deltas = [call for c in chunks for call in c.choices[0].delta.tool_calls or []]
    assert {d.index for d in deltas} == {0} and deltas[0].function.name == "get_weather"
    assert all(d.function.name is None and d.id is None for d in deltas[1:])
    call = deltas[0].model_copy(deep=True)
    call.function.arguments = "".join(d.function.arguments or "" for d in deltas)
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMETERS)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    answer_with_the_result(client, messages, call)


@pytest.mark.slow
def test_forced_calls_of_tools_whose_schemas_refer_into_themselves(client):
    """Pydantic-made schemas (MCP servers, agent SDKs) keep shared parts in `$defs`; wrapped
    into the call's schema, "#/$defs/..." once pointed at nothing and the request was a 400."""
    item = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    defs_tool = {"type": "function", "function": {"name": "plan_trip", "parameters": {
        "type": "object", "properties": {"stop": {"$ref": "#/$defs/Stop"}},
        "required": ["stop"], "$defs": {"Stop": item}}}}  # fmt: skip
    other = {"type": "function", "function": {"name": "note", "parameters": {
        "type": "object", "properties": {"at": {"$ref": "#/$defs/Stop"}}, "required": ["at"],
        "$defs": {"Stop": {"type": "object", "properties": {"n": {"type": "integer"}},
                           "required": ["n"]}}}}}  # fmt: skip
    for tools in ([defs_tool], [defs_tool, other]):  # one schema, and two whose $defs clash
        reply = client.chat.completions.create(
            model="default", messages=weather_question(), tools=tools, tool_choice="required",
            temperature=0, max_tokens=60,
        )  # fmt: skip
        (call,) = reply.choices[0].message.tool_calls
        arguments = json.loads(call.function.arguments)
        chosen = next(t for t in tools if t["function"]["name"] == call.function.name)
        jsonschema.validate(arguments, chosen["function"]["parameters"])
