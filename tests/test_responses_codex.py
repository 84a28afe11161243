"""The Responses API as Codex uses it: a first request Codex CLI 0.171 sent (captured in
tests/data), replayed against a real server whose model is scripted, and read back with the
official `openai` client (its stream helper rebuilds the response from the events and fails
on events out of order or items that change identity). Namespace, custom and built-in tools,
reasoning sent back, and the requests that must get a 400 naming the field."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import openai
import pytest
from fake_engine import ReplyingEngine, ToolTemplateTokenizer, hermes_call
from server_helpers import running_server

from server.core.chat_request import Usage
from server.core.turn_events import ToolCallArguments, ToolCallEnd, ToolCallStart, TurnEnd
from server.http.limits import MAX_TOOLS
from server.responses.output import ResponseBuilder
from server.responses.protocol import ResponseObject, TextConfig
from server.responses.tools import ToolSet, read_tools

CAPTURE = json.loads((Path(__file__).parent / "data" / "codex_responses_request.json").read_text())
BODY = CAPTURE["body"]
# Codex's own headers (its session, turn and window ids), sent along as Codex sends them.
HEADERS = {
    name: value for name, value in CAPTURE["headers"].items()
    if name.startswith("x-") or name in ("originator", "session-id", "thread-id")
}  # fmt: skip
# Codex's apply_patch, a custom tool with a lark grammar (as Codex sends it for gpt-5.5).
APPLY_PATCH = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Use the `apply_patch` tool to edit files. This is a FREEFORM tool.",
    "format": {
        "type": "grammar",
        "syntax": "lark",
        "definition": 'start: begin_patch hunk+ end_patch\nbegin_patch: "*** Begin Patch" LF\n',
    },
}
PATCH = '*** Begin Patch\n*** Add File: note.txt\n+say "hi"\\n\n*** End Patch\n'
MESSAGE_EVENTS = (
    "response.output_item.added response.content_part.added( response.output_text.delta)+ "
    "response.output_text.done response.content_part.done response.output_item.done"
)


def scripted_server(script: list[str], finish_reason: str = "stop"):
    """A server whose model says `script` to every request, with a Hermes template and
    room for Codex's whole prompt (one token per character)."""
    engine = ReplyingEngine(
        lambda prompt: script, ToolTemplateTokenizer(), max_model_len=1 << 17,
        finish_reason=finish_reason,
    )  # fmt: skip
    return engine, running_server(engine)


def client_of(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)


def codex_fields(**changes) -> dict:
    """The captured request as `responses.create` keyword arguments (without `stream`)."""
    fields = {key: value for key, value in {**BODY, **changes}.items() if key != "stream"}
    extra = {"client_metadata": fields.pop("client_metadata")}
    return {**fields, "extra_body": extra, "extra_headers": HEADERS}


def last_prompt(engine) -> tuple[list, list[dict]]:
    """The offered tools and the messages of the latest prompt (one JSON line each)."""
    tools_line, *turns, _ = list(engine.prompts.values())[-1].split("\n")
    return json.loads(tools_line.removeprefix("tools: ")), [json.loads(t) for t in turns]


def test_the_captured_codex_request_streams_a_call_codex_can_run():
    engine, server = scripted_server(["Let me look. ", *hermes_call("exec_command", {"cmd": "ls"})])
    with server as url:
        raw = httpx.post(f"{url}/v1/responses", json=BODY, headers=HEADERS, timeout=30)
        events = list(client_of(url).responses.create(stream=True, **codex_fields()))
        with client_of(url).responses.stream(**codex_fields()) as stream:
            final = stream.get_final_response()
    assert raw.status_code == 200 and raw.headers["content-type"].startswith("text/event-stream")
    kinds = " ".join(event.type for event in events)
    call_events = (
        "response.output_item.added( response.function_call_arguments.delta)+ "
        "response.function_call_arguments.done response.output_item.done"
    )
    assert re.fullmatch(
        f"response.created response.in_progress {MESSAGE_EVENTS} {call_events} response.completed",
        kinds,
    ), kinds
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert [item.type for item in final.output] == ["message", "function_call"]
    call = final.output[1]
    assert call.name == "exec_command" and call.namespace is None
    assert json.loads(call.arguments) == {"cmd": "ls"}
    assert final.tools is not None and len(final.tools) == len(BODY["tools"])  # echoed


def test_namespace_members_are_offered_and_built_in_tools_left_out():
    engine, server = scripted_server(["Hello."])
    with server as url:
        client_of(url).responses.create(stream=True, **codex_fields()).close()
    offered, turns = last_prompt(engine)
    names = [tool["function"]["name"] for tool in offered]
    namespace = next(tool for tool in BODY["tools"] if tool["type"] == "namespace")
    members = [f"multi_agent_v1.{member['name']}" for member in namespace["tools"]]
    plain = [tool["name"] for tool in BODY["tools"] if tool["type"] == "function"]
    assert sorted(names) == sorted(plain + members)  # web_search is not offered
    close = offered[names.index("multi_agent_v1.close_agent")]["function"]
    assert close["description"].startswith(f"Part of `multi_agent_v1`: {namespace['description']}")
    assert close["parameters"] == namespace["tools"][0]["parameters"]
    assert [turn["role"] for turn in turns] == ["system", "system", "user", "user"]
    assert turns[-1]["content"] == "Write hello to out.txt"


def test_a_namespaced_call_comes_back_with_its_namespace_and_goes_back_in():
    arguments = {"target": "agent-1"}
    engine, server = scripted_server(hermes_call("multi_agent_v1.close_agent", arguments))
    with server as url:
        with client_of(url).responses.stream(**codex_fields()) as stream:
            [call] = stream.get_final_response().output
        assert (call.type, call.name, call.namespace) == (
            "function_call", "close_agent", "multi_agent_v1",
        )  # fmt: skip
        # The next turn, as Codex sends it: reasoning from another server (opaque encrypted
        # content), the call with its namespace, and its output.
        reasoning = {"type": "reasoning", "id": "rs_1", "summary": [], "content": None,
                     "encrypted_content": "gAAAAABopaque-from-elsewhere=="}  # fmt: skip
        output = {"type": "function_call_output", "call_id": call.call_id,
                  "output": "agent-1 closed"}  # fmt: skip
        turn = [*BODY["input"], reasoning, call.model_dump(exclude_none=True), output]
        client_of(url).responses.create(stream=True, **codex_fields(input=turn)).close()
    _, turns = last_prompt(engine)
    assert turns[-2]["tool_calls"][0]["function"] == {
        "name": "multi_agent_v1.close_agent", "arguments": arguments,
    }  # fmt: skip
    assert turns[-1] == {"role": "tool", "content": "agent-1 closed", "tool_call_id": call.call_id}
    assert "opaque" not in list(engine.prompts.values())[-1]


def test_a_custom_tool_call_streams_its_input():
    engine, server = scripted_server(["Patching.", *hermes_call("apply_patch", {"input": PATCH})])
    fields = codex_fields(tools=[*BODY["tools"], APPLY_PATCH])
    with server as url:
        events = list(client_of(url).responses.create(stream=True, **fields))
        with client_of(url).responses.stream(**fields) as stream:
            final = stream.get_final_response()
        whole = client_of(url).responses.create(**{**fields, "extra_body": {"stream": False}})
    kinds = " ".join(event.type for event in events)
    custom_events = (
        "response.output_item.added( response.custom_tool_call_input.delta)+ "
        "response.custom_tool_call_input.done response.output_item.done"
    )
    assert re.fullmatch(
        f"response.created response.in_progress {MESSAGE_EVENTS} {custom_events} "
        "response.completed",
        kinds,
    ), kinds
    deltas = [e.delta for e in events if e.type == "response.custom_tool_call_input.delta"]
    assert "".join(deltas) == PATCH
    added = [e for e in events if e.type == "response.output_item.added"][-1]
    assert added.item.type == "custom_tool_call" and added.item.input == ""
    assert events[-3].input == PATCH
    for response in (final, whole):
        call = response.output[1]
        assert (call.type, call.name, call.input) == ("custom_tool_call", "apply_patch", PATCH)
    offered, _ = last_prompt(engine)
    patch_tool = next(t["function"] for t in offered if t["function"]["name"] == "apply_patch")
    assert patch_tool["parameters"]["required"] == ["input"]
    assert APPLY_PATCH["format"]["definition"] in patch_tool["description"]


def test_a_custom_tool_call_and_its_output_go_back_in():
    engine, server = scripted_server(["Done."])
    call = {"type": "custom_tool_call", "id": "ctc_1", "status": "completed",
            "call_id": "call_1", "name": "apply_patch", "input": PATCH}  # fmt: skip
    output = {"type": "custom_tool_call_output", "id": "ctco_1", "call_id": "call_1",
              "output": "Success. Updated the following files:\nA note.txt\n"}  # fmt: skip
    turn = [*BODY["input"], call, output]
    fields = codex_fields(input=turn, tools=[*BODY["tools"], APPLY_PATCH])
    with server as url:
        response = client_of(url).responses.create(**{**fields, "extra_body": {}})
    assert response.output_text == "Done."
    _, turns = last_prompt(engine)
    assert turns[-2]["tool_calls"][0]["function"] == {
        "name": "apply_patch", "arguments": {"input": PATCH},
    }  # fmt: skip
    assert turns[-1]["role"] == "tool" and turns[-1]["content"] == output["output"]


def test_reasoning_comes_with_null_encrypted_content_and_goes_back_out():
    engine, server = scripted_server(["<think>", "Look first.", "</think>", "Hi."])
    with server as url:
        response = client_of(url).responses.create(**{**codex_fields(), "extra_body": {}})
        reasoning = response.output[0].model_dump()
        turn = [*BODY["input"], reasoning, {"role": "user", "content": "Again."}]
        again = client_of(url).responses.create(**{**codex_fields(input=turn), "extra_body": {}})
    assert reasoning["type"] == "reasoning" and reasoning["encrypted_content"] is None
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Look first."}]
    assert again.status == "completed"
    assert "Look first." not in list(engine.prompts.values())[-1]


def test_without_max_output_tokens_the_answer_may_fill_the_context():
    engine, server = scripted_server(["Hi."])
    with server as url:
        client_of(url).responses.create(stream=True, **codex_fields()).close()
    [(request_id, prompt)] = engine.prompts.items()
    assert engine.params[request_id].max_tokens == engine.max_model_len - len(prompt)


def test_a_turn_cut_off_in_a_call_ends_a_well_formed_stream():
    cut = ['<tool_call>{"name": "exec_command", ', '"arguments": {"cmd": "printf hel']
    engine, server = scripted_server(["Writing.", *cut], finish_reason="length")
    with server as url:
        events = list(client_of(url).responses.create(stream=True, **codex_fields()))
        with client_of(url).responses.stream(**codex_fields()) as stream:
            final = list(stream)[-1].response  # the helper checks the order, not the status
    added = [e.output_index for e in events if e.type == "response.output_item.added"]
    done = [e.output_index for e in events if e.type == "response.output_item.done"]
    assert added == done and events[-1].type == "response.incomplete"
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    [call] = [item for item in final.output if item.type == "function_call"]
    assert (call.name, call.status, call.arguments) == (
        "exec_command", "incomplete", '{"cmd": "printf hel'
    )  # not a call to run: Codex runs only completed ones


def test_a_call_still_open_at_the_end_is_closed_incomplete():
    """The turn events of a call cut off by the length limit: start, a fragment, its end
    (incomplete), the turn's end."""
    builder = ResponseBuilder(_response(), read_tools([APPLY_PATCH]))
    builder.start()
    cut = '{"input": "*** Begin Patch\\n*** Add'
    events = builder.add(ToolCallStart("apply_patch"))
    events += builder.add(ToolCallArguments(cut))
    events += builder.add(ToolCallEnd("apply_patch", cut, complete=False))
    events += builder.add(TurnEnd("length", None, Usage.of(10, 5, 0)))
    assert [event["type"] for event in events] == [
        "response.output_item.added", "response.custom_tool_call_input.delta",
        "response.custom_tool_call_input.done", "response.output_item.done",
        "response.incomplete",
    ]  # fmt: skip
    [call] = builder.result().output
    assert (call.type, call.status, call.input) == (
        "custom_tool_call", "incomplete", "*** Begin Patch\n*** Add",
    )  # fmt: skip


def _response() -> ResponseObject:
    return ResponseObject(
        id="resp_1", status="in_progress", instructions=None, max_output_tokens=None,
        model="m", parallel_tool_calls=True, temperature=None, text=TextConfig(),
        tool_choice="auto", tools=[], top_p=None,
    )  # fmt: skip


def test_a_call_of_a_tool_not_offered_passes_through_as_written():
    builder = ResponseBuilder(_response(), ToolSet([]))
    builder.add(ToolCallStart("get_weather"))
    [call] = builder.result().output
    assert (call.type, call.name, call.namespace) == ("function_call", "get_weather", None)


# ---- requests that must get a 400 naming the field ---------------------------------------

FUNCTION = {"type": "function", "name": "f", "parameters": {"type": "object"}}
# (tools or other fields, the error's param)
BAD_REQUESTS = [
    ({"tools": [{"type": "hologram"}]}, "tools[0].type"),
    ({"tools": [FUNCTION, {"name": "g"}]}, "tools[1].type"),
    ({"tools": [{"type": "function"}]}, "tools[0].name"),
    ({"tools": [{**FUNCTION, "name": "bad name!"}]}, "tools[0].name"),
    ({"tools": [{"type": "namespace", "tools": [FUNCTION]}]}, "tools[0].name"),
    ({"tools": [{"type": "namespace", "name": "ns", "tools": []}]}, "tools[0].tools"),
    ({"tools": [{"type": "namespace", "name": "ns"}]}, "tools[0].tools"),
    ({"tools": [{"type": "namespace", "name": "ns", "tools": ["f"]}]}, "tools[0].tools[0]"),
    ({"tools": [{**FUNCTION, "name": "a.b"}, {"type": "namespace", "name": "a",
                                             "tools": [{**FUNCTION, "name": "b"}]}]},
     "tools[1].tools[0].name"),
    ({"tools": [{"type": "namespace", "name": "ns",
                 "tools": [{"type": "namespace", "name": "inner", "tools": [FUNCTION]}]}]},
     "tools[0].tools[0].type"),
    ({"tools": [{"type": "namespace", "name": "ns", "tools": [{"type": "web_search"}]}]},
     "tools[0].tools[0].type"),
    ({"tools": [{"type": "namespace", "name": "ns", "tools": [FUNCTION, {"type": "function"}]}]},
     "tools[0].tools[1].name"),
    ({"tools": [{"type": "namespace", "name": "ns", "tools": [FUNCTION, FUNCTION]}]},
     "tools[0].tools[1].name"),
    ({"tools": [FUNCTION, {**APPLY_PATCH, "name": "f"}]}, "tools[1].name"),
    ({"tools": [{"type": "namespace", "name": "n" * 60, "tools": [{**FUNCTION, "name": "long"}]}]},
     "tools[0].tools[0].name"),
    ({"tools": [{**APPLY_PATCH, "format": {"type": "yaml"}}]}, "tools[0].format.type"),
    ({"tools": [{**FUNCTION, "parameters": "none"}]}, "tools[0].parameters"),
    ({"tools": [{**FUNCTION, "name": f"f{i}"} for i in range(MAX_TOOLS + 1)]}, "tools"),
    ({"tools": "all"}, "tools"),
    ({"tools": [APPLY_PATCH], "tool_choice": {"type": "custom", "name": "nope"}}, "tool_choice"),
    ({"tools": [APPLY_PATCH], "tool_choice": {"type": "function", "name": "apply_patch"}},
     "tool_choice"),
    ({"tool_choice": {"type": "web_search"}}, "tool_choice"),
    ({"input": [{"type": "custom_tool_call", "call_id": "c", "name": "apply_patch"}]},
     "input[0]"),
    ({"input": [{"type": "custom_tool_call_output", "call_id": "c"}]}, "input[0]"),
]  # fmt: skip


def test_bad_tools_and_items_get_openai_errors_naming_the_field():
    engine, server = scripted_server(["Hi."])
    with server as url:
        for fields, param in BAD_REQUESTS:
            body = {"model": "m", "input": "Hi", **fields}
            response = httpx.post(f"{url}/v1/responses", json=body, timeout=30)
            assert response.status_code == 400, (fields, response.text)
            error = response.json()["error"]
            assert error["type"] == "invalid_request_error"
            assert error["param"] == param, (fields, error)
    assert engine.prompts == {}  # none reached the engine


@pytest.mark.parametrize("tools", [
    [{"type": "web_search", "external_web_access": False}],
    [{"type": kind} for kind in ("file_search", "image_generation", "code_interpreter",
                                 "computer_use_preview", "mcp", "local_shell", "tool_search")],
])  # fmt: skip
def test_built_in_tools_are_accepted_and_not_offered(tools):
    engine, server = scripted_server(["Hi."])
    with server as url:
        response = httpx.post(f"{url}/v1/responses", json={"input": "Hi", "tools": tools},
                              timeout=30)  # fmt: skip
    assert response.status_code == 200, response.text
    assert response.json()["tools"] == tools
    assert list(engine.prompts.values())[-1].startswith("tools: null\n")


@pytest.mark.parametrize(("tool_choice", "call"), [
    ({"type": "custom", "name": "apply_patch"}, ("custom_tool_call", "apply_patch", None)),
    ({"type": "function", "name": "close_agent", "namespace": "multi_agent_v1"},
     ("function_call", "close_agent", "multi_agent_v1")),
])  # fmt: skip
def test_tool_choice_names_a_custom_or_namespaced_tool(tool_choice, call):
    """A named choice is generated as one forced call of that tool (the model's JSON)."""
    name = ".".join(filter(None, [call[2], call[1]]))
    arguments = {"input": PATCH} if call[0] == "custom_tool_call" else {"target": "agent-1"}
    engine, server = scripted_server([json.dumps({"name": name, "arguments": arguments})])
    fields = codex_fields(tools=[*BODY["tools"], APPLY_PATCH], tool_choice=tool_choice)
    with server as url:
        response = client_of(url).responses.create(**{**fields, "extra_body": {}})
    [item] = response.output
    assert (item.type, item.name, item.namespace) == call
    [params] = engine.params.values()
    assert json.loads(params.structured.json_schema)["properties"]["name"]["enum"] == [name]


def test_an_image_in_a_tool_output_becomes_a_note():
    """Codex's view_image answers with an image part; a 400 would end the session."""
    engine, server = scripted_server(["I see."])
    call = {"type": "function_call", "call_id": "call_1", "name": "view_image",
            "arguments": '{"path": "plot.png"}'}  # fmt: skip
    output = {"type": "function_call_output", "call_id": "call_1", "output": [
        {"type": "input_text", "text": "plot.png:"},
        {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="},
    ]}  # fmt: skip
    with server as url:
        response = httpx.post(f"{url}/v1/responses", timeout=30, json={
            **BODY, "stream": False, "input": [*BODY["input"], call, output],
        })  # fmt: skip
    assert response.status_code == 200, response.text
    _, turns = last_prompt(engine)
    assert turns[-1]["content"] == "plot.png:[image left out: this model reads text only]"


# A tool's type, or a namespace member's, that is not a string (it was looked up in a set).
GARBAGE_TOOLS = [
    ([{"type": ["function"]}], "tools[0].type"),
    ([{"type": {"name": "f"}}], "tools[0].type"),
    ([{"type": 3}], "tools[0].type"),
    ([{"name": "f"}], "tools[0].type"),
    (["function"], "tools[0]"),
    ([{"type": "function", "name": ["f"]}], "tools[0].name"),
    ([{"type": "namespace", "name": "ns", "tools": [{"type": ["custom"], "name": "c"}]}],
     "tools[0].tools[0].type"),
    ([{"type": "namespace", "name": "ns", "tools": ["f"]}], "tools[0].tools[0]"),
    ([{"type": "namespace", "name": {"ns": 1}, "tools": [{"type": "function", "name": "f"}]}],
     "tools[0].name"),
    ([{"type": "function", "name": "has space"}], "tools[0].name"),
]  # fmt: skip


def test_tools_of_the_wrong_shape_are_a_400_naming_the_field():
    engine, server = scripted_server(["Hi."])
    with server as url:
        for tools, param in GARBAGE_TOOLS:
            body = {"model": "m", "input": "Hi", "tools": tools}
            response = httpx.post(f"{url}/v1/responses", json=body, timeout=30)
            assert response.status_code == 400, (tools, response.text)
            assert response.json()["error"]["param"] == param, (tools, response.text)
    assert engine.prompts == {}


def test_a_namespace_member_takes_the_chat_apis_tool_names():
    from server.core.chat_request_tools import MAX_TOOL_NAME_LENGTH

    member = {"type": "function", "name": "m" * (MAX_TOOL_NAME_LENGTH - 3)}
    tools = read_tools([{"type": "namespace", "name": "ns", "tools": [member]}])
    [chat] = tools.chat_tools()
    assert chat["function"]["name"] == "ns." + member["name"]  # exactly the longest name
