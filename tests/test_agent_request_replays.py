"""The first requests Claude Code 2.1 and opencode 1.18 send (captured from the real CLIs,
tests/data/), replayed through the official clients against a real server: they get a 200
and the event sequence their SDKs rebuild a message from."""

from __future__ import annotations

import json
import re
from pathlib import Path

import anthropic
import openai
from fake_engine import LengthEngine, ReplyingEngine, ToolTemplateTokenizer, hermes_call
from server_helpers import running_server

DATA = Path(__file__).parent / "data"
CLAUDE_CODE = json.loads((DATA / "claude_code_messages_request.json").read_text())
OPENCODE = json.loads((DATA / "opencode_chat_request.json").read_text())
BIG_CONTEXT = 200_000  # the fake tokenizer spends a token per character
RAW_EVENTS = {
    "message_start", "content_block_start", "content_block_delta", "content_block_stop",
    "message_delta", "message_stop",
}  # fmt: skip


def claude_code_request() -> tuple[dict, list[str]]:
    """Its body as the client's keyword arguments (the helper sets `stream`), and its betas."""
    body = {key: value for key, value in CLAUDE_CODE["body"].items() if key != "stream"}
    return body, CLAUDE_CODE["headers"]["anthropic-beta"].split(",")


def test_claude_code_request_gets_a_tool_use_stream():
    body, betas = claude_code_request()
    write = {"file_path": "/home/user/project/hello.txt", "content": "hi\n"}
    script = ["Sure. ", *hermes_call("Write", write)]
    engine = ReplyingEngine(lambda _: script, ToolTemplateTokenizer(), BIG_CONTEXT)
    with running_server(engine) as url:
        client = anthropic.Anthropic(base_url=url, api_key="dummy", max_retries=0)
        with client.beta.messages.stream(betas=betas, **body) as stream:
            # (The helper also yields events of its own, such as "text", among the wire's.)
            kinds = " ".join(e.type for e in stream if e.type in RAW_EVENTS)
            message = stream.get_final_message()
    block = "content_block_start( content_block_delta)+ content_block_stop"
    assert re.fullmatch(f"message_start {block} {block} message_delta message_stop", kinds), kinds
    assert [block.type for block in message.content] == ["text", "tool_use"]
    assert message.content[1].name == "Write" and message.content[1].input == write
    assert message.stop_reason == "tool_use"
    # What the model saw: Claude Code's system prompt and tools, less what it must not see.
    prompt = next(iter(engine.prompts.values()))
    tools_line, system_line = prompt.split("\n")[:2]
    offered = [tool["function"]["name"] for tool in json.loads(tools_line.removeprefix("tools: "))]
    assert "Write" in offered and "Bash" in offered
    assert "DeferredToolPlaceholder" not in offered  # defer_loading: out until loaded
    system = json.loads(system_line)
    assert system["role"] == "system" and "# Environment" in system["content"]
    assert "x-anthropic-billing-header" not in prompt


def test_claude_code_max_tokens_is_capped_at_the_context():
    """It asks for 128000 tokens; a context with 12 left gives 12 and `max_tokens`, and
    count_tokens counts its request shape as the call does."""
    body, betas = claude_code_request()
    assert body["max_tokens"] == 128000
    engine = LengthEngine(["Hi"], ToolTemplateTokenizer())
    engine.max_model_len = BIG_CONTEXT
    with running_server(engine) as url:
        client = anthropic.Anthropic(base_url=url, api_key="dummy", max_retries=0)
        shape = {key: body[key] for key in ("model", "messages", "system", "tools", "thinking")}
        counted = client.messages.count_tokens(**shape).input_tokens
        engine.max_model_len = counted + 12
        with client.beta.messages.stream(betas=betas, **body) as stream:
            message = stream.get_final_message()
    assert message.stop_reason == "max_tokens"
    assert message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0) == counted
    assert message.usage.output_tokens == 12
    assert message.content[0].text == "Hi" * 12


def test_opencode_request_gets_a_tool_call_stream():
    body = dict(OPENCODE["body"])
    assert body["max_tokens"] == 32000 and body["stream"]
    write = {"content": "hi\n", "filePath": "/home/user/project/hello.txt"}
    script = hermes_call("write", write)
    engine = ReplyingEngine(lambda _: script, ToolTemplateTokenizer(), BIG_CONTEXT)
    with running_server(engine) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="dummy", max_retries=0)
        chunks = list(client.chat.completions.create(**body))
    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    calls = [call for delta in deltas for call in delta.tool_calls or []]
    assert calls[0].id and calls[0].type == "function" and calls[0].function.name == "write"
    assert json.loads("".join(call.function.arguments or "" for call in calls)) == write
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert chunks[-1].usage.prompt_tokens == len(next(iter(engine.prompts.values())))
    assert not any(delta.content for delta in deltas)  # no raw call syntax leaks as text
