"""GPT-OSS turns behind the real server: a fake engine says scripted harmony token ids (one a
step, as a model would), and every API, whole and streamed, read with the official clients,
shows the analysis channel as reasoning, a `functions.*` message as a tool call and the
final channel as content."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import anthropic
import openai
import pytest
from fake_engine import ScriptedEngine
from harmony_tokenizer import gpt_oss_tokenizer
from server_helpers import running_server

from metal_engine.outputs import RequestOutput
from server.core.harmony_encoding import harmony_encoding

WEATHER_QUESTION = "What is the weather in Paris?"
GREETING = "Hi there"
CALL_TURN = (
    "<|channel|>analysis<|message|>The user wants the weather; call get_weather.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris", "unit": "C"}<|call|>'
)
ANSWER_TURN = (
    "<|channel|>analysis<|message|>A greeting; answer kindly.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Hello! How can I help?<|return|>"
)
# A forced call: the prompt opens the call, the model writes only its arguments.
FORCED_HEADER = " to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>"
FORCED_ARGUMENTS = '{"city": "Paris", "unit": "C"}<|call|>'
PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
    "required": ["city"],
}


@dataclass
class Outcome:
    """What a client saw of one turn, in the same terms on every API."""

    reasoning: str = ""
    content: str = ""
    calls: list[tuple[str, dict]] = field(default_factory=list)
    ended_for_calls: bool = False


EXPECTED = {
    "call": Outcome("The user wants the weather; call get_weather.", "",
                    [("get_weather", {"city": "Paris", "unit": "C"})], True),
    "answer": Outcome("A greeting; answer kindly.", "Hello! How can I help?", [], False),
}  # fmt: skip


class HarmonyEngine(ScriptedEngine):
    """Says harmony token ids, one a step: the tool call for the weather question, else the
    greeting's answer. Its text deltas are the tokenizer's, special tokens left out."""

    def __init__(self) -> None:
        super().__init__([], gpt_oss_tokenizer())
        encoding = harmony_encoding(self.tokenizer)
        self.turns = {
            name: encoding.encode(text, allowed_special="all")
            for name, text in (("call", CALL_TURN), ("answer", ANSWER_TURN),
                               ("forced", FORCED_ARGUMENTS))
        }

    def script_for(self, request_id: str) -> list[int]:  # type: ignore[override]
        prompt = self.prompts[request_id]
        if prompt.endswith(FORCED_HEADER):
            return self.turns["forced"]
        return self.turns["call" if WEATHER_QUESTION in prompt else "answer"]

    def step(self) -> list[RequestOutput]:
        outputs = []
        for request_id, state in list(self.live.items()):
            script = self.scripts[request_id]
            token = script[state[1]]
            state[1] += 1
            reason = "stop" if state[1] == len(script) else None
            if reason:
                del self.live[request_id]
            text = self.tokenizer.decode([token], skip_special_tokens=True)
            outputs.append(RequestOutput(request_id, [token], text, reason, state[0], state[1]))
        return outputs


@pytest.fixture(scope="module")
def engine():
    return HarmonyEngine()


@pytest.fixture(scope="module")
def base_url(engine):
    with running_server(engine) as url:
        yield url


def ask_chat(base_url: str, question: str, stream: bool) -> Outcome:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMETERS}}]
    fields = {"model": "gpt-oss", "messages": [{"role": "user", "content": question}],
              "tools": tools}  # fmt: skip
    if not stream:
        choice = client.chat.completions.create(**fields).choices[0]
        message = choice.message
        calls = [(c.function.name, json.loads(c.function.arguments))
                 for c in message.tool_calls or []]  # fmt: skip
        reasoning = (message.model_extra or {}).get("reasoning_content") or ""
        ended_for_calls = choice.finish_reason == "tool_calls"
        return Outcome(reasoning, message.content or "", calls, ended_for_calls)
    outcome, arguments, names, finish = Outcome(), {}, {}, None
    for chunk in client.chat.completions.create(**fields, stream=True):
        delta = chunk.choices[0].delta
        outcome.reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        outcome.content += delta.content or ""
        for call in delta.tool_calls or []:
            if call.function.name:
                names[call.index] = call.function.name
            arguments[call.index] = arguments.get(call.index, "") + call.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    outcome.calls = [(names[i], json.loads(arguments[i])) for i in sorted(names)]
    outcome.ended_for_calls = finish == "tool_calls"
    return outcome


def ask_responses(base_url: str, question: str, stream: bool) -> Outcome:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0)
    tools = [{"type": "function", "name": "get_weather", "parameters": PARAMETERS}]
    fields = {"model": "gpt-oss", "input": question, "tools": tools}
    if stream:
        events = list(client.responses.create(**fields, stream=True))
        deltas = {kind: "".join(e.delta for e in events if e.type == f"response.{kind}.delta")
                  for kind in ("reasoning_text", "output_text")}  # fmt: skip
        response = events[-1].response
        assert deltas["reasoning_text"] == _reasoning_of(response)
        assert deltas["output_text"] == response.output_text
    else:
        response = client.responses.create(**fields)
    calls = [(item.name, json.loads(item.arguments)) for item in response.output
             if item.type == "function_call"]  # fmt: skip
    return Outcome(_reasoning_of(response), response.output_text, calls, bool(calls))


def _reasoning_of(response) -> str:
    items = [item for item in response.output if item.type == "reasoning"]
    return "".join(part.text for item in items for part in item.content or [])


def ask_messages(base_url: str, question: str, stream: bool) -> Outcome:
    client = anthropic.Anthropic(base_url=base_url, api_key="x", max_retries=0)
    tools = [{"name": "get_weather", "input_schema": PARAMETERS}]
    fields = {"model": "gpt-oss", "max_tokens": 256, "tools": tools,
              "messages": [{"role": "user", "content": question}]}  # fmt: skip
    if stream:
        with client.messages.stream(**fields) as events:
            message = events.get_final_message()
    else:
        message = client.messages.create(**fields)
    blocks = message.content
    return Outcome(
        "".join(b.thinking for b in blocks if b.type == "thinking"),
        "".join(b.text for b in blocks if b.type == "text"),
        [(b.name, b.input) for b in blocks if b.type == "tool_use"],
        message.stop_reason == "tool_use",
    )


ASK = {"chat": ask_chat, "responses": ask_responses, "messages": ask_messages}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("api", sorted(ASK))
@pytest.mark.parametrize(("turn", "question"), [("call", WEATHER_QUESTION), ("answer", GREETING)])
def test_reasoning_calls_and_content_on_every_api(base_url, api, stream, turn, question):
    assert ASK[api](base_url, question, stream) == EXPECTED[turn]


def test_the_engine_gets_harmony_prompts_and_stops(base_url, engine):
    ask_chat(base_url, WEATHER_QUESTION, stream=False)
    request_id = list(engine.prompts)[-1]
    prompt, params = engine.prompts[request_id], engine.params[request_id]
    assert "<|start|>developer<|message|># Tools" in prompt and "type get_weather" in prompt
    assert prompt.endswith(f"<|start|>user<|message|>{WEATHER_QUESTION}<|end|><|start|>assistant")
    assert {200002, 200012} <= set(params.stop_token_ids)  # <|return|>, <|call|>


@pytest.mark.parametrize(("effort", "rendered"), [("high", "high"), ("minimal", "low"),
                                                  ("xhigh", "high")])
def test_responses_reasoning_effort_reaches_the_system_message(base_url, engine, effort,
                                                               rendered):
    """Codex sends `reasoning.effort`; harmony's system message carries it (OpenAI's
    efforts harmony lacks land on the nearest)."""
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0)
    client.responses.create(model="gpt-oss", input=WEATHER_QUESTION,
                            reasoning={"effort": effort, "summary": "auto"})
    prompt = engine.prompts[list(engine.prompts)[-1]]
    assert f"Reasoning: {rendered}" in prompt


def test_an_unknown_responses_reasoning_effort_is_a_400(base_url):
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.create(model="gpt-oss", input="hi", reasoning={"effort": "extreme"})
    assert error.value.body["param"] == "reasoning.effort"


FORCED_CALL = [("get_weather", {"city": "Paris", "unit": "C"})]


def forced_on_chat(client: openai.OpenAI, stream: bool) -> list[tuple[str, dict]]:
    fields = {"model": "gpt-oss", "messages": [{"role": "user", "content": GREETING}],
              "tools": [{"type": "function", "function": {"name": "get_weather",
                                                          "parameters": PARAMETERS}}],
              "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    if not stream:
        message = client.chat.completions.create(**fields).choices[0].message
        return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]
    names, arguments = {}, {}
    for chunk in client.chat.completions.create(**fields, stream=True):
        for call in chunk.choices[0].delta.tool_calls or []:
            names[call.index] = call.function.name or names.get(call.index)
            arguments[call.index] = arguments.get(call.index, "") + call.function.arguments
    return [(names[i], json.loads(arguments[i])) for i in sorted(names)]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_named_tool_choice_opens_the_call_in_the_prompt(base_url, engine, stream):
    """Harmony can open a call after `<|start|>assistant`: the prompt ends with its header,
    the arguments are sampled under the function's schema, and they come out as that call."""
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0)
    assert forced_on_chat(client, stream) == FORCED_CALL
    request_id = list(engine.prompts)[-1]
    assert engine.prompts[request_id].endswith("<|start|>assistant" + FORCED_HEADER)
    assert json.loads(engine.params[request_id].structured.json_schema) == PARAMETERS


def test_forced_calls_on_responses_and_messages(base_url):
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0)
    response = client.responses.create(
        model="gpt-oss", input=GREETING, tool_choice={"type": "function", "name": "get_weather"},
        tools=[{"type": "function", "name": "get_weather", "parameters": PARAMETERS}])
    assert [(i.name, json.loads(i.arguments)) for i in response.output
            if i.type == "function_call"] == FORCED_CALL  # fmt: skip
    claude = anthropic.Anthropic(base_url=base_url, api_key="x", max_retries=0)
    message = claude.messages.create(
        model="gpt-oss", max_tokens=64, messages=[{"role": "user", "content": GREETING}],
        tools=[{"name": "get_weather", "input_schema": PARAMETERS}],
        tool_choice={"type": "any"})  # `any` with one tool: that tool
    assert [(b.name, b.input) for b in message.content if b.type == "tool_use"] == FORCED_CALL
    assert message.stop_reason == "tool_use"


def test_required_among_several_tools_is_a_400(base_url):
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0)
    tools = [{"type": "function", "function": {"name": n, "parameters": PARAMETERS}}
             for n in ("get_weather", "get_time")]
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="gpt-oss", tools=tools, tool_choice="required",
                                       messages=[{"role": "user", "content": GREETING}])
    assert error.value.body["param"] == "tool_choice"
