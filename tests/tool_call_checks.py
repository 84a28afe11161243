"""What every tool-call family must do through the server: a scripted model answers with
"Checking. ", then a get_weather call (Paris, 3 days) and a write_file call of `code`; the
official openai client gets them whole, or streamed as tool-call deltas, and the official
anthropic client as tool_use blocks, whole or streamed."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager

import anthropic
import openai
from fake_engine import ScriptedEngine
from server_helpers import running_server

MESSAGES = [{"role": "user", "content": "Weather in Paris, then write a.py?"}]
CONTENT = "Checking. "


def expected_calls(code: str) -> list[tuple[str, dict]]:
    return [("get_weather", {"city": "Paris", "days": 3}),
            ("write_file", {"path": "a.py", "content": code})]


def check_whole_response(client: openai.OpenAI, tools: list[dict], code: str) -> None:
    reply = client.chat.completions.create(model="default", messages=MESSAGES, tools=tools)
    choice = reply.choices[0]
    assert (choice.finish_reason, choice.message.content) == ("tool_calls", CONTENT)
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert calls == expected_calls(code)


def check_streamed_deltas(client: openai.OpenAI, tools: list[dict], code: str) -> None:
    stream = client.chat.completions.create(model="default", messages=MESSAGES, tools=tools,
                                            stream=True)  # fmt: skip
    chunks = [chunk for chunk in stream if chunk.choices]
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    names = [(d.index, d.function.name) for d in deltas if d.function.name]
    arguments = ["".join(d.function.arguments or "" for d in deltas if d.index == i)
                 for i in (0, 1)]  # fmt: skip
    assert content == CONTENT
    assert names == [(0, "get_weather"), (1, "write_file")]
    assert [(name, json.loads(a)) for (_, name), a in zip(names, arguments, strict=True)] == \
        expected_calls(code)
    assert len([d for d in deltas if d.index == 1]) > 5  # the file's text streamed


def check_anthropic_tool_use(client: openai.OpenAI, tools: list[dict], code: str) -> None:
    """The same answer through the Messages API (its client on `client`'s server): a text
    block, then a tool_use block a call; streamed, the file's text comes in many
    input_json_delta events and the client's stream helper rebuilds the same message."""
    url = str(client.base_url).rstrip("/").removesuffix("/v1")
    messages = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0).messages
    fields = dict(model="default", max_tokens=512, messages=MESSAGES, tools=[
        {"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
        for t in tools])  # fmt: skip
    whole = messages.create(**fields)
    with messages.stream(**fields) as stream:
        events = list(stream)
        rebuilt = stream.get_final_message()
    for message in (whole, rebuilt):
        assert message.stop_reason == "tool_use"
        assert [block.type for block in message.content] == ["text", "tool_use", "tool_use"]
        assert message.content[0].text == CONTENT
        assert [(b.name, b.input) for b in message.content[1:]] == expected_calls(code)
    assert len({b.id for b in whole.content[1:]}) == 2
    file_deltas = [e for e in events if e.type == "content_block_delta" and e.index == 2]
    assert all(e.delta.type == "input_json_delta" for e in file_deltas)
    assert len(file_deltas) > 5


@contextmanager
def scripted_client(tokenizer, text: str) -> Iterator[openai.OpenAI]:
    """An openai client of a server whose model says `text` in pieces of 3 characters."""
    script = [text[i : i + 3] for i in range(0, len(text), 3)]
    with running_server(ScriptedEngine(script, tokenizer)) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none")
