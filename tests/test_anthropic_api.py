"""The Anthropic Messages API, driven by the official `anthropic` client (its stream helper
rebuilds the message from the events, and fails on events out of order): on the default model,
and on a scripted model that fixes what the model says."""

from __future__ import annotations

import json
import re

import anthropic
import httpx
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
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER_TOOL = {
    "name": "get_weather",
    "description": "The current weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris right now?"}]
# One text block: start, deltas, stop; then the message's end.
TEXT_EVENTS = (
    "message_start content_block_start( content_block_delta)+ content_block_stop "
    "message_delta message_stop"
)


@pytest.fixture(scope="module")
def engine(default_model_dir):
    return small_engine(default_model_dir, MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def client(base_url) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url, api_key="x", max_retries=0)


def greedy(**fields) -> dict:
    # This client version has no sampling arguments: temperature travels as an extra field.
    return {"model": "default", "max_tokens": 24, "extra_body": {"temperature": 0}, **fields}


def raw_events(client: anthropic.Anthropic, **fields) -> list:
    return list(client.messages.create(stream=True, **greedy(**fields)))


def streamed_message(client: anthropic.Anthropic, **fields):
    with client.messages.stream(**greedy(**fields)) as stream:
        return stream.get_final_message()


def prompt_tokens(usage) -> int:
    # Anthropic counts prefix-cache reads apart from input_tokens.
    return usage.input_tokens + (usage.cache_read_input_tokens or 0)


@pytest.mark.slow
def test_text_matches_chat_completions(client, base_url):
    message = client.messages.create(**greedy(messages=QUESTION))
    chat = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0)
    reply = chat.chat.completions.create(
        model="default", messages=QUESTION, temperature=0, max_tokens=24
    )
    assert message.role == "assistant" and message.id.startswith("msg_")
    assert [block.type for block in message.content] == ["text"]
    assert "Paris" in message.content[0].text
    assert message.content[0].text == reply.choices[0].message.content
    finish = reply.choices[0].finish_reason
    assert message.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[finish]
    assert message.stop_sequence is None
    assert prompt_tokens(message.usage) == reply.usage.prompt_tokens
    assert message.usage.output_tokens == reply.usage.completion_tokens


@pytest.mark.slow
def test_stream_events_come_in_order(client):
    whole = client.messages.create(**greedy(messages=QUESTION))
    events = raw_events(client, messages=QUESTION)
    kinds = " ".join(event.type for event in events)
    assert re.fullmatch(TEXT_EVENTS, kinds), kinds
    start = events[0].message
    assert start.content == [] and start.stop_reason is None
    assert prompt_tokens(start.usage) == prompt_tokens(whole.usage)
    assert events[1].index == 0 and events[1].content_block.type == "text"
    assert all(event.index == 0 for event in events[1:-2])
    text = "".join(event.delta.text for event in events if event.type == "content_block_delta")
    assert text == whole.content[0].text
    assert events[-2].delta.stop_reason == whole.stop_reason
    assert events[-2].usage.output_tokens == whole.usage.output_tokens
    rebuilt = streamed_message(client, messages=QUESTION)
    assert [block.text for block in rebuilt.content] == [whole.content[0].text]


@pytest.mark.slow
def test_stop_sequences(client):
    text = client.messages.create(**greedy(messages=QUESTION)).content[0].text
    stop = "Paris"
    assert stop in text
    message = client.messages.create(
        **greedy(messages=QUESTION, stop_sequences=["no such text", stop])
    )
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert message.content[0].text == text[: text.index(stop)]
    end = raw_events(client, messages=QUESTION, stop_sequences=[stop])[-2]
    assert end.delta.stop_reason == "stop_sequence" and end.delta.stop_sequence == stop


@pytest.mark.slow
def test_tool_use_round_trip(client, base_url):
    first = client.messages.create(**greedy(
        max_tokens=64, messages=WEATHER_QUESTION, tools=[WEATHER_TOOL],
        tool_choice={"type": "any"},
    ))  # fmt: skip
    assert first.stop_reason == "tool_use"
    calls = [block for block in first.content if block.type == "tool_use"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert isinstance(calls[0].input["city"], str) and calls[0].id.startswith("toolu_")

    result = {"type": "tool_result", "tool_use_id": calls[0].id, "content": "18 C and sunny"}
    conversation = [
        *WEATHER_QUESTION,
        {"role": "assistant", "content": first.content},
        {"role": "user", "content": [result]},
    ]
    answer = client.messages.create(**greedy(
        max_tokens=32, messages=conversation, tools=[WEATHER_TOOL], tool_choice={"type": "none"}
    ))  # fmt: skip
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert [block.type for block in answer.content] == ["text"]
    assert answer.content[0].text.strip()
    # The same conversation through chat completions: the same prompt and answer.
    function = {"name": "get_weather", "arguments": json.dumps(calls[0].input)}
    messages = [
        *WEATHER_QUESTION,
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": calls[0].id, "type": "function", "function": function}]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": result["content"]},
    ]  # fmt: skip
    chat = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0)
    reply = chat.chat.completions.create(
        model="default", messages=messages, temperature=0, max_tokens=32, tool_choice="none",
        tools=[{"type": "function", "function": {
            "name": WEATHER_TOOL["name"], "description": WEATHER_TOOL["description"],
            "parameters": WEATHER_TOOL["input_schema"],
        }}],
    )  # fmt: skip
    assert prompt_tokens(answer.usage) == reply.usage.prompt_tokens
    assert answer.content[0].text == reply.choices[0].message.content


@pytest.mark.slow
def test_streamed_tool_use_matches_whole(client):
    fields = dict(
        max_tokens=64, messages=WEATHER_QUESTION, tools=[WEATHER_TOOL],
        tool_choice={"type": "tool", "name": "get_weather"},
    )  # fmt: skip
    whole = client.messages.create(**greedy(**fields))
    events = raw_events(client, **fields)
    kinds = " ".join(event.type for event in events)
    assert re.fullmatch(
        "message_start content_block_start (content_block_delta )+content_block_stop "
        "message_delta message_stop",
        kinds,
    ), kinds
    block = events[1].content_block
    assert block.type == "tool_use" and block.name == "get_weather" and block.input == {}
    assert events[2].delta.type == "input_json_delta"
    assert events[-2].delta.stop_reason == "tool_use"
    [tool_use] = streamed_message(client, **fields).content
    assert tool_use.type == "tool_use" and tool_use.input == whole.content[0].input


@pytest.mark.slow
def test_count_tokens_equals_the_prompt_the_call_reports(client):
    fields = dict(
        system=[{"type": "text", "text": "You are a terse assistant."}],
        messages=WEATHER_QUESTION, tools=[WEATHER_TOOL],
    )  # fmt: skip
    counted = client.messages.count_tokens(model="default", **fields).input_tokens
    message = client.messages.create(**greedy(max_tokens=4, **fields))
    assert prompt_tokens(message.usage) == counted
    without_tools = {key: value for key, value in fields.items() if key != "tools"}
    assert client.messages.count_tokens(model="default", **without_tools).input_tokens < counted


@pytest.mark.slow
def test_system_messages_inside_messages_join_the_system_prompt(client):
    system = "You are a terse assistant."
    as_field = client.messages.count_tokens(model="default", system=system, messages=QUESTION)
    inside = client.messages.count_tokens(
        model="default", messages=[{"role": "system", "content": system}, *QUESTION]
    )
    alone = client.messages.count_tokens(model="default", messages=QUESTION)
    # (Without one, the template puts in its own default system prompt.)
    assert as_field.input_tokens == inside.input_tokens != alone.input_tokens


# ---- scripted model text: what the translation sends and how the answer is built ------------

SCRIPT = TEXT_THEN_HERMES_CALL


@pytest.fixture(scope="module")
def scripted():
    """(client, engine, url) of a server whose model always says SCRIPT, with a Hermes
    template."""
    engine = ScriptedEngine(SCRIPT, ToolTemplateTokenizer())
    with running_server(engine) as url:
        yield anthropic.Anthropic(base_url=url, api_key="x", max_retries=0), engine, url


def test_text_then_tool_use_blocks(scripted):
    client, _, _ = scripted
    fields = dict(model="m", max_tokens=64, messages=WEATHER_QUESTION, tools=[WEATHER_TOOL])
    message = client.messages.create(**fields)
    assert [block.type for block in message.content] == ["text", "tool_use"]
    assert message.content[0].text == "Let me check. "
    assert message.content[1].name == "get_weather"
    assert message.content[1].input == {"city": "Paris"}
    assert message.stop_reason == "tool_use"

    events = list(client.messages.create(stream=True, **fields))
    kinds = " ".join(event.type for event in events)
    assert re.fullmatch(
        "message_start content_block_start( content_block_delta)+ content_block_stop "
        "content_block_start content_block_delta content_block_stop message_delta message_stop",
        kinds,
    ), kinds
    assert [e.index for e in events if e.type == "content_block_start"] == [0, 1]
    assert [e.index for e in events if e.type == "content_block_stop"] == [0, 1]
    assert events[-2].delta.stop_reason == "tool_use"
    with client.messages.stream(**fields) as stream:
        rebuilt = stream.get_final_message()
    assert rebuilt.content[0].text == "Let me check. "
    assert rebuilt.content[1].input == {"city": "Paris"}


def test_conversation_reaches_the_template_as_chat_messages(scripted):
    client, engine, _ = scripted
    tool_use = {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                "input": {"city": "Paris"}}  # fmt: skip
    result = {"type": "tool_result", "tool_use_id": "toolu_1",
              "content": [{"type": "text", "text": "18 C"}]}  # fmt: skip
    conversation = [
        {"role": "system", "content": "Also be kind."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"},
                                     {"type": "text", "text": "Be quick."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me check."}, tool_use]},
        {"role": "user", "content": [result, {"type": "text", "text": "Thanks!"}]},
    ]  # fmt: skip
    fields = dict(model="m", system="Be brief.", messages=conversation, tools=[WEATHER_TOOL])
    message = client.messages.create(max_tokens=64, **fields)
    prompt = list(engine.prompts.values())[-1]
    tools_line, *turns, _ = prompt.split("\n")  # one JSON line per message
    call = {"id": "toolu_1", "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}  # fmt: skip
    assert [json.loads(turn) for turn in turns] == [
        {"role": "system", "content": "Be brief.\n\nAlso be kind."},
        {"role": "user", "content": "Weather in Paris?\n\nBe quick."},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [call]},
        {"role": "tool", "content": "18 C", "tool_call_id": "toolu_1"},
        {"role": "user", "content": "Thanks!"},
    ]
    [tool] = json.loads(tools_line.removeprefix("tools: "))
    assert tool["function"]["parameters"] == WEATHER_TOOL["input_schema"]
    assert message.usage.input_tokens == len(prompt)  # one token per character
    assert client.messages.count_tokens(**fields).input_tokens == len(prompt)


def offered_tool_names(prompt: str) -> list[str]:
    tools = json.loads(prompt.split("\n")[0].removeprefix("tools: "))
    return [tool["function"]["name"] for tool in tools]


TIME_TOOL = {"name": "get_time", "description": "The time.",
             "input_schema": {"type": "object", "properties": {}}}  # fmt: skip
SEARCH_TOOL = {"name": "ToolSearch", "description": "Loads deferred tools.",
               "input_schema": {"type": "object", "properties": {"query": {"type": "string"}}}}
WEB_SEARCH = {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}


def test_server_and_deferred_tools_stay_out_of_the_prompt(scripted):
    """Claude Code sends server tools (web search) and deferred tools by default: they are
    accepted, and the model is told only of the client tools it may call now."""
    client, engine, _ = scripted
    tools = [WEATHER_TOOL, WEB_SEARCH, {**TIME_TOOL, "defer_loading": True}]
    message = client.messages.create(
        model="m", max_tokens=64, messages=WEATHER_QUESTION, tools=tools,
        tool_choice={"type": "tool", "name": "web_search"},  # (Claude Code's web search call)
    )  # fmt: skip
    assert offered_tool_names(list(engine.prompts.values())[-1]) == ["get_weather"]
    assert [block.type for block in message.content] == ["text", "tool_use"]
    only_server = client.messages.create(
        model="m", max_tokens=64, messages=WEATHER_QUESTION, tools=[WEB_SEARCH],
        tool_choice={"type": "any"},
    )  # fmt: skip
    assert not list(engine.prompts.values())[-1].startswith("tools: [{")  # no tools at all
    assert [block.type for block in only_server.content] == ["text"]  # call syntax as text


def test_tool_search_and_tool_changes_load_and_unload_tools(scripted):
    """A tool_result's `tool_reference` and a system message's `tool_addition` put a tool in
    the prompt; `tool_removal` takes one out (Claude Code's ToolSearch, MCP changes)."""
    client, engine, _ = scripted
    new_tool = {"name": "get_tide", "description": "The tide.",
                "input_schema": {"type": "object", "properties": {}}}  # fmt: skip
    search = {"type": "tool_use", "id": "toolu_1", "name": "ToolSearch",
              "input": {"query": "select:get_time"}}  # fmt: skip
    found = {"type": "tool_result", "tool_use_id": "toolu_1",
             "content": [{"type": "tool_reference", "tool_name": "get_time"}]}  # fmt: skip
    changes = [
        {"type": "tool_addition", "tool": {"type": "tool_definition", "definition": new_tool}},
        {"type": "tool_removal", "tool": {"type": "tool_reference", "name": "get_weather"}},
    ]
    conversation = [
        *WEATHER_QUESTION,
        {"role": "assistant", "content": [search]},
        {"role": "user", "content": [found]},
        {"role": "system", "content": changes},
    ]
    tools = [SEARCH_TOOL, WEATHER_TOOL, {**TIME_TOOL, "defer_loading": True}]
    client.messages.create(model="m", max_tokens=64, messages=conversation, tools=tools)
    prompt = list(engine.prompts.values())[-1]
    assert offered_tool_names(prompt) == ["ToolSearch", "get_time", "get_tide"]
    result = json.loads(prompt.split("\n")[-2])
    assert result == {"role": "tool", "content": "Tool get_time loaded.", "tool_call_id": "toolu_1"}
    assert '"role": "system"' not in prompt  # the tool changes carry no text


def test_claude_code_request_fields_are_accepted(scripted):
    """thinking (each kind), metadata, cache_control, context_management and beta headers
    change nothing in the prompt; Claude Code's billing header block is left out of it."""
    client, engine, url = scripted
    plain = {"model": "m", "max_tokens": 64, "system": "Be brief.", "messages": WEATHER_QUESTION,
             "tools": [WEATHER_TOOL]}  # fmt: skip
    client.messages.create(**plain)
    expected = list(engine.prompts.values())[-1]
    cached = {"cache_control": {"type": "ephemeral"}}
    marked = {
        **plain,
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1;"},
                   {"type": "text", "text": "Be brief.", **cached}],
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": WEATHER_QUESTION[0]["content"], **cached}]}],
        "tools": [{**WEATHER_TOOL, **cached}],
        "metadata": {"user_id": "someone"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "medium"},
    }  # fmt: skip
    headers = {"anthropic-version": "2023-06-01",
               "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14"}
    for thinking in ({"type": "enabled", "budget_tokens": 1024}, {"type": "disabled"},
                     {"type": "adaptive", "display": "omitted"}):  # fmt: skip
        response = httpx.post(
            f"{url}/v1/messages", json={**marked, "thinking": thinking}, headers=headers
        )
        assert response.status_code == 200, response.text
        assert list(engine.prompts.values())[-1] == expected
        counted = httpx.post(f"{url}/v1/messages/count_tokens", json=marked, headers=headers)
        assert counted.json() == {"input_tokens": len(expected)}


def test_reasoning_comes_as_a_thinking_block():
    script = ["<think>", "Paris is in ", "France.", "</think>", "\nParis."]
    engine = ScriptedEngine(script)
    with running_server(engine) as url:
        client = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
        fields = dict(model="m", max_tokens=64, messages=QUESTION)
        message = client.messages.create(**fields)
        events = list(client.messages.create(stream=True, **fields))
        follow_up = [*QUESTION, {"role": "assistant", "content": message.content},
                     {"role": "user", "content": "And of Spain?"}]  # fmt: skip
        client.messages.create(model="m", max_tokens=64, messages=follow_up)
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == "Paris is in France."
    assert message.content[1].text == "\nParis."
    assert message.stop_reason == "end_turn"
    starts = [event for event in events if event.type == "content_block_start"]
    assert [(e.index, e.content_block.type) for e in starts] == [(0, "thinking"), (1, "text")]
    deltas = [event.delta for event in events if event.type == "content_block_delta"]
    thinking = "".join(d.thinking for d in deltas if d.type == "thinking_delta")
    assert thinking == "Paris is in France."
    assert "".join(d.text for d in deltas if d.type == "text_delta") == "\nParis."
    # Sent back, the thinking stays out of the next prompt; the answer goes in.
    prompt = list(engine.prompts.values())[-1]
    assert "Paris is in France." not in prompt and "assistant: \nParis.\n" in prompt


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}
# (fields, a piece of the error message): wrong for both /v1/messages and count_tokens.
BAD_PROMPTS = [
    ({"messages": []}, "messages"),
    ({"tools": [{"name": f"t{i}", "input_schema": {"type": "object"}} for i in range(513)]},
     "at most 512"),
    ({"messages": [{"role": "user", "content": [IMAGE]}]},
     "messages[0].content[0].source: this model reads text only"),
    ({"messages": [*QUESTION, {"role": "assistant", "content": "The"}]}, "prefill"),
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "tool", "name": "nope"}}, "'nope'"),
    ({"tool_choice": {"type": "any"}}, "needs tools"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}, "tool_use_id"),
    ({"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1",
         "content": [{"type": "text", "text": "A paper:"}, {"type": "document"}]}
    ]}]}, "messages[0].content[0].content[1]: a tool_result holds a block of type 'document'"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"},
                                                {"type": "mystery"}]}]},
     "messages[0].content[1]: content blocks of type 'mystery' are not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "messages[0].content[0]: a text block has no 'text'"),
    ({"messages": [*QUESTION, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather"}
    ]}, *QUESTION]}, "messages[1].content[0]: a tool_use block needs id, name and input"),
    ({"messages": [{"role": "user", "content": [{"text": "no type"}]}]}, "type: Field required"),
    ({"messages": [*QUESTION, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": "Paris"}
    ]}, *QUESTION]}, "input: Input should be a valid dictionary"),
    ({"system": [IMAGE]}, "system[0]: content blocks of type 'image'"),
    ({"tools": [{"name": "get_weather"}]}, "needs an input_schema"),
]  # fmt: skip
# Wrong only where a message is generated.
BAD_SAMPLING = [
    ({"max_tokens": None}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": 1.5}, "temperature"),
    ({"stop_sequences": [str(i) for i in range(40)]}, "stop_sequences"),
]


@pytest.mark.parametrize(
    ("path", "cases"),
    [
        ("/v1/messages", BAD_PROMPTS + BAD_SAMPLING),
        ("/v1/messages/count_tokens", BAD_PROMPTS),
    ],
)
def test_bad_requests_get_anthropic_errors(scripted, path, cases):
    _, engine, url = scripted
    prompts_before = len(engine.prompts)
    for fields, fragment in cases:
        body = {"model": "m", "max_tokens": 8, "messages": QUESTION, **fields}
        body = {key: value for key, value in body.items() if value is not None}
        response = httpx.post(f"{url}{path}", json=body)
        assert response.status_code == 400, (fields, response.text)
        payload = response.json()
        assert payload["type"] == "error", payload
        assert payload["error"]["type"] == "invalid_request_error"
        assert fragment in payload["error"]["message"], payload
    assert len(engine.prompts) == prompts_before  # none reached the engine


def test_client_raises_bad_request_error(scripted):
    client, _, _ = scripted
    with pytest.raises(anthropic.BadRequestError) as raised:
        client.messages.create(model="m", max_tokens=8, messages=[])
    assert raised.value.body["error"]["type"] == "invalid_request_error"


def test_an_engine_failure_is_an_anthropic_error():
    body = {"model": "m", "max_tokens": 8, "messages": QUESTION}
    with running_server(FailingEngine(["Hello", " there"])) as url:
        whole = httpx.post(f"{url}/v1/messages", json=body)
        client = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
        stream = client.messages.create(stream=True, **body)
        seen = []
        with pytest.raises(anthropic.APIStatusError) as raised:
            seen.extend(event.type for event in stream)
    assert whole.status_code == 500
    assert whole.json()["type"] == "error" and whole.json()["error"]["type"] == "api_error"
    # Generic: the engine's own text may hold a prompt (docs/hardening.md, Errors).
    assert raised.value.body["error"]["message"].startswith("The engine failed")
    assert "the device fell over" not in raised.value.body["error"]["message"]
    assert raised.value.body["error"]["type"] == "api_error"
    assert seen[-1] == "content_block_delta"  # "Hello" went out before the failure


def test_a_client_that_leaves_aborts_its_request():
    engine = SlowEngine(["word "] * 1000)  # 10 s of output
    body = {"model": "m", "max_tokens": 2000, "messages": QUESTION}
    with running_server(engine) as url:
        with httpx.stream("POST", f"{url}/v1/messages", json={**body, "stream": True}) as r:
            next(line for line in r.iter_lines() if line == "event: content_block_delta")
        wait_until_aborted(engine, 1)
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{url}/v1/messages", json=body, timeout=0.5)
        wait_until_aborted(engine, 2)


def test_a_tool_choice_naming_a_tool_not_offered_is_a_400_unless_a_server_tool(scripted):
    """Only a server tool's name falls back to auto (nothing here runs it); a client tool
    taken out by a tool_removal must not be forced, nor silently ignored."""
    _, engine, url = scripted
    removal = {"type": "tool_removal", "tool": {"type": "tool_reference", "name": "get_weather"}}
    body = {"model": "m", "max_tokens": 8, "tools": [WEATHER_TOOL, TIME_TOOL],
            "tool_choice": {"type": "tool", "name": "get_weather"},
            "messages": [{"role": "system", "content": [removal]}, *WEATHER_QUESTION]}  # fmt: skip
    prompts_before = len(engine.prompts)
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        response = httpx.post(f"{url}{path}", json=body)
        assert response.status_code == 400, response.text
        assert "tool_choice names 'get_weather'" in response.json()["error"]["message"]
    assert len(engine.prompts) == prompts_before
    server_tool = {**body, "tools": [WEATHER_TOOL, WEB_SEARCH], "messages": WEATHER_QUESTION,
                   "tool_choice": {"type": "tool", "name": "web_search"}}  # fmt: skip
    assert httpx.post(f"{url}/v1/messages", json=server_tool).status_code == 200


@pytest.mark.parametrize("name", ["get weather", "t" * 65, ""])
def test_tool_names_follow_the_chat_apis_rule_deferred_or_not(scripted, name):
    # A deferred tool never reached the chat request's checks, and could be loaded later.
    _, _, url = scripted
    for tool in ({**TIME_TOOL, "name": name}, {**TIME_TOOL, "name": name, "defer_loading": True}):
        body = {"model": "m", "max_tokens": 8, "messages": QUESTION, "tools": [tool]}
        response = httpx.post(f"{url}/v1/messages", json=body)
        assert response.status_code == 400, (tool, response.text)
        assert "tools.0.name" in response.json()["error"]["message"]
