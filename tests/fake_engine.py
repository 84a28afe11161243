"""Engines and tokenizers without a model, for server tests that fix what the model says."""

from __future__ import annotations

import json
import time

from metal_engine.outputs import EngineStats, RequestOutput


class CharTokenizer:
    """One token per character; the chat template is `role: content` lines."""

    chat_template = "lines"

    def __len__(self) -> int:
        return 256

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        assert add_generation_prompt and not tokenize
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [min(ord(c), 255) for c in text]

    def decode(self, token_ids: list[int]) -> str:
        return "".join(map(chr, token_ids))


class ToolTemplateTokenizer(CharTokenizer):
    """A chat template with Hermes tool syntax: it gets the tools and the tool messages as
    they are, and renders each turn as its JSON."""

    chat_template = "{% for tool in tools %}<tool_call>{% endfor %}"

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, tools=None):
        assert add_generation_prompt and not tokenize
        lines = [f"tools: {json.dumps(tools)}"] + [json.dumps(m) for m in messages]
        return "\n".join(lines) + "\nassistant: "


# What a tool-calling model says: some text, then a Hermes tool call cut at awkward places.
WEATHER_CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
TEXT_THEN_HERMES_CALL = [
    "Let me check. ", "<tool_", "call>", WEATHER_CALL[:25], WEATHER_CALL[25:], "</tool_call>",
]


def hermes_call(name: str, arguments: dict) -> list[str]:
    """The pieces a model says for one Hermes call, cut inside the tag, before the name, in
    the middle and before the closing braces: a streaming parser must join them anywhere."""
    text = json.dumps({"name": name, "arguments": arguments})
    cuts = [0, 9, len(text) // 2, len(text) - 3, len(text)]
    pieces = [text[start:end] for start, end in zip(cuts, cuts[1:], strict=False)]
    return ["<tool_", "call>", *pieces, "</tool_call>"]


def tool_results(prompt: str) -> list[dict]:
    """The tool messages of a prompt ToolTemplateTokenizer rendered (one JSON a line between
    the tools line and the generation prompt): what a CLI sent back after running a call."""
    turns = [json.loads(line) for line in prompt.split("\n")[1:-1]]
    return [turn for turn in turns if turn["role"] == "tool"]


class ScriptedEngine:
    """Every request gets the same text, one scripted piece per step, then stops. Subclasses
    pick each request's script (`script_for`) and how it ends (`finish_reason`); the stepping
    is this class's alone."""

    model_name = "scripted"
    max_model_len = 4096
    finish_reason = "stop"

    def __init__(self, script: list[str], tokenizer: CharTokenizer | None = None) -> None:
        self.script = script
        self.tokenizer = tokenizer or CharTokenizer()
        self.live: dict[str, list] = {}  # request id -> [prompt length, pieces sent]
        self.prompts: dict[str, str] = {}  # request id -> its prompt, decoded
        self.params: dict = {}  # request id -> its SamplingParams
        self.scripts: dict[str, list[str]] = {}  # request id -> the pieces it gets

    def add_request(self, request_id, prompt_token_ids, params, priority=0, cache_salt=None):
        self.live[request_id] = [len(prompt_token_ids), 0]
        self.prompts[request_id] = self.tokenizer.decode(prompt_token_ids)
        self.params[request_id] = params
        self.scripts[request_id] = self.script_for(request_id)

    def script_for(self, request_id: str) -> list[str]:
        """What the request is told; called once its prompt and params are recorded."""
        return self.script

    def abort_request(self, request_id):
        self.live.pop(request_id, None)

    def has_unfinished_requests(self):
        return bool(self.live)

    def stats(self) -> EngineStats:
        return EngineStats()

    def close(self):
        pass

    def step(self):
        outputs = []
        for request_id, state in list(self.live.items()):
            script = self.scripts[request_id]
            piece = script[state[1]]
            state[1] += 1
            reason = self.finish_reason if state[1] == len(script) else None
            if reason:
                del self.live[request_id]
            outputs.append(
                RequestOutput(request_id, [ord(piece[0]) if piece else 0], piece, reason,
                              state[0], state[1])
            )  # fmt: skip
        return outputs


class FailingEngine(ScriptedEngine):
    """Says its script's first piece, then fails at the next step."""

    def step(self):
        if any(sent for _, sent in self.live.values()):
            raise RuntimeError("the device fell over")
        return super().step()


class SlowEngine(ScriptedEngine):
    """Takes 10 ms a step, and records the requests it is told to abort."""

    def __init__(self, script: list[str]) -> None:
        super().__init__(script)
        self.aborted: list[str] = []

    def step(self):
        time.sleep(0.01)
        return super().step()

    def abort_request(self, request_id):
        self.aborted.append(request_id)
        super().abort_request(request_id)


def wait_until_aborted(engine: SlowEngine, count: int) -> None:
    deadline = time.monotonic() + 5
    while len(engine.aborted) < count or engine.live:
        assert time.monotonic() < deadline, "the server did not abort the request"
        time.sleep(0.02)


class ReplyingEngine(ScriptedEngine):
    """Answers each request with the script that `reply` picks from its prompt (a
    conversation that moves on as tool results come back); ends each with `finish_reason`."""

    def __init__(self, reply, tokenizer=None, max_model_len=4096, finish_reason="stop"):
        super().__init__([], tokenizer)
        self.reply = reply
        self.max_model_len = max_model_len
        self.finish_reason = finish_reason

    def script_for(self, request_id: str) -> list[str]:
        return self.reply(self.prompts[request_id])


class LengthEngine(ScriptedEngine):
    """Says its script over and over, one token a step, until the request's max_tokens: every
    request ends with the "length" reason, after exactly the max_tokens the server passed."""

    finish_reason = "length"

    def script_for(self, request_id: str) -> list[str]:
        max_tokens = self.params[request_id].max_tokens
        repeats = -(-max_tokens // len(self.script))
        return (self.script * repeats)[:max_tokens]


class RecordingEngine(ScriptedEngine):
    """Says "ok"; keeps each request's prompt ids."""

    def __init__(self, tokenizer) -> None:
        super().__init__(["ok"], tokenizer)
        self.prompt_ids: list[list[int]] = []

    def add_request(self, request_id, prompt_token_ids, params, priority=0, cache_salt=None):
        self.prompt_ids.append(list(prompt_token_ids))
        super().add_request(request_id, prompt_token_ids, params, priority)
