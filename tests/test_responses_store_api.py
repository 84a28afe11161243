"""Stored responses through the official `openai` client on a real server: `GET` and `DELETE
/v1/responses/{id}`, follow-ups with `previous_response_id` (their prompt is the stored
conversation and the new input, as if the client had sent it all), API keys kept apart, and
the count bound."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

import httpx
import openai
import pytest
from fake_engine import (
    TEXT_THEN_HERMES_CALL,
    FailingEngine,
    LengthEngine,
    ScriptedEngine,
    ToolTemplateTokenizer,
)
from server_helpers import running_app, running_server

from server.app import HttpOptions, build_app
from server.async_engine import AsyncEngine
from server.responses import store
from server.responses.store import StoreLimits

QUESTION = "What is the capital of France?"
FOLLOW_UP = "And of Spain?"
KEY_A, KEY_B = "sk-key-a", "sk-key-b"
WEATHER_TOOL = {
    "type": "function", "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}  # fmt: skip


def openai_client(url: str, api_key: str = "x") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0)


@contextlib.contextmanager
def scripted(
    script: list[str], tokenizer=None
) -> Iterator[tuple[openai.OpenAI, ScriptedEngine, str]]:
    """(client, engine, base URL) of a server whose model always says `script`."""
    engine = ScriptedEngine(script, tokenizer)
    with running_server(engine) as url:
        yield openai_client(url), engine, url


def last_prompt(engine: ScriptedEngine) -> str:
    return list(engine.prompts.values())[-1]


def assert_unknown(url: str, response_id: str, api_key: str = "x") -> None:
    """GET and DELETE answer 404 with OpenAI's error body, and a follow-up a 400."""
    headers = {"Authorization": f"Bearer {api_key}"}
    for method in ("GET", "DELETE"):
        answer = httpx.request(method, f"{url}/v1/responses/{response_id}", headers=headers)
        assert answer.status_code == 404, (method, answer.text)
        assert answer.json()["error"] == {
            "message": f"Response with id '{response_id}' not found.",
            "type": "not_found_error", "param": None, "code": None,
        }  # fmt: skip
    client = openai_client(url, api_key)
    with pytest.raises(openai.BadRequestError) as raised:
        client.responses.create(model="m", input=FOLLOW_UP, previous_response_id=response_id)
    assert raised.value.code == "previous_response_not_found"
    assert raised.value.param == "previous_response_id"
    assert f"'{response_id}' not found" in raised.value.message


def test_a_stored_response_is_retrieved_then_deleted():
    engine = ScriptedEngine(["Paris", "."])
    with running_server(engine) as url:
        client = openai_client(url)
        created = client.responses.create(model="m", input=QUESTION, metadata={"k": "v"})
        assert created.store is True and created.previous_response_id is None  # the default
        retrieved = client.responses.retrieve(created.id)
        assert retrieved.model_dump() == created.model_dump()
        assert retrieved.output_text == "Paris." and retrieved.status == "completed"
        assert client.responses.delete(created.id) is None  # the client returns nothing
        deleted = httpx.delete(f"{url}/v1/responses/{created.id}")
        assert deleted.status_code == 404  # already gone
        assert_unknown(url, created.id)
        not_kept = client.responses.create(model="m", input=QUESTION, store=False)
        assert not_kept.store is False
        assert_unknown(url, not_kept.id)


def test_deleting_answers_the_deletion_object():
    with scripted(["Paris."]) as (client, _, url):
        created = client.responses.create(model="m", input=QUESTION)
        answer = httpx.delete(f"{url}/v1/responses/{created.id}")
    assert answer.status_code == 200
    assert answer.json() == {"id": created.id, "object": "response", "deleted": True}


def test_a_follow_up_prompt_is_the_stored_conversation_then_its_input():
    with scripted(["Paris."]) as (client, engine, _):
        first = client.responses.create(model="m", input=QUESTION, instructions="Be brief.")
        second = client.responses.create(
            model="m", input=FOLLOW_UP, previous_response_id=first.id, instructions="Be kind."
        )
        chained = last_prompt(engine)
        with client.responses.stream(
            model="m", input="And of Italy?", previous_response_id=second.id
        ) as stream:
            third = stream.get_final_response()
        third_prompt = last_prompt(engine)
        # The same conversation sent whole, without the store.
        whole = [{"role": "user", "content": QUESTION},
                 *[item.model_dump(exclude_none=True) for item in first.output],
                 {"role": "user", "content": FOLLOW_UP}]  # fmt: skip
        client.responses.create(model="m", input=whole, instructions="Be kind.", store=False)
        assert last_prompt(engine) == chained
        streamed_stored = client.responses.retrieve(third.id)
    # Instructions are not carried over (as in OpenAI's API): only the latest request's.
    assert chained == (
        f"system: Be kind.\nuser: {QUESTION}\nassistant: Paris.\nuser: {FOLLOW_UP}\nassistant: "
    )
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == len(chained) > first.usage.input_tokens
    assert third_prompt == (
        f"user: {QUESTION}\nassistant: Paris.\nuser: {FOLLOW_UP}\nassistant: Paris.\n"
        "user: And of Italy?\nassistant: "
    )
    assert third.usage.input_tokens == len(third_prompt)
    # A stream is stored once done (the helper's final response adds `parsed` to each part).
    assert streamed_stored.output_text == third.output_text == "Paris."
    assert streamed_stored.usage == third.usage
    assert streamed_stored.previous_response_id == second.id == third.previous_response_id


def test_a_tool_result_continues_the_call_it_answers():
    with scripted(TEXT_THEN_HERMES_CALL, ToolTemplateTokenizer()) as (client, engine, _):
        first = client.responses.create(model="m", input="Weather in Paris?",
                                        tools=[WEATHER_TOOL])
        call = first.output[1]
        result = {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}
        client.responses.create(
            model="m", input=[result], previous_response_id=first.id, tools=[WEATHER_TOOL]
        )
    _, *turns, _ = last_prompt(engine).split("\n")
    tool_call = {"id": call.call_id, "type": "function",
                 "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    assert [json.loads(turn) for turn in turns] == [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me check. ", "tool_calls": [tool_call]},
        {"role": "tool", "content": "18 C", "tool_call_id": call.call_id},
    ]  # fmt: skip


@pytest.mark.parametrize("scope", ["key", "shared"])
def test_one_key_cannot_read_continue_or_delete_anothers(scope):
    engine = ScriptedEngine(["Paris."])
    options = HttpOptions(api_keys=(KEY_A, KEY_B), prefix_cache_scope=scope)
    with running_app(build_app(AsyncEngine(engine), options=options)) as url:
        client_a = openai_client(url, KEY_A)
        created = client_a.responses.create(model="m", input=QUESTION)
        prompts = len(engine.prompts)
        assert_unknown(url, created.id, api_key=KEY_B)
        assert len(engine.prompts) == prompts  # B's follow-up never reached the engine
        # Still there for A, and A may continue from it.
        assert client_a.responses.retrieve(created.id).id == created.id
        client_a.responses.create(model="m", input=FOLLOW_UP, previous_response_id=created.id)
        assert QUESTION in last_prompt(engine)
        # B's own responses are B's.
        client_b = openai_client(url, KEY_B)
        own = client_b.responses.create(model="m", input=QUESTION)
        assert client_b.responses.retrieve(own.id).id == own.id
        assert_unknown(url, own.id, api_key=KEY_A)


def test_the_count_bound_evicts_the_oldest(monkeypatch):
    monkeypatch.setattr(store, "DEFAULT_LIMITS", StoreLimits(max_responses=2))
    with scripted(["Paris."]) as (client, _, url):
        first, second, third = (client.responses.create(model="m", input=QUESTION)
                                for _ in range(3))  # fmt: skip
        assert_unknown(url, first.id)
        assert client.responses.retrieve(second.id).id == second.id  # now third is the oldest
        fourth = client.responses.create(model="m", input=QUESTION)
        assert_unknown(url, third.id)
        assert {client.responses.retrieve(r.id).id for r in (second, fourth)} == {
            second.id, fourth.id,
        }


def test_an_incomplete_response_is_stored_and_a_failed_one_is_not():
    with running_server(LengthEngine(["word "])) as url:
        cut = openai_client(url).responses.create(model="m", input=QUESTION, max_output_tokens=3)
        assert cut.status == "incomplete"
        assert openai_client(url).responses.retrieve(cut.id).status == "incomplete"
    with running_server(FailingEngine(["Hello", " there"])) as url:
        events = list(openai_client(url).responses.create(model="m", input=QUESTION, stream=True))
        assert events[-1].type == "response.failed"
        assert_unknown(url, events[-1].response.id)


def test_render_refuses_a_follow_up_it_cannot_read():
    with scripted(["Paris."]) as (client, _, url):
        first = client.responses.create(model="m", input=QUESTION)
        body = {"model": "m", "input": FOLLOW_UP, "previous_response_id": first.id}
        answer = httpx.post(f"{url}/v1/responses/render", json=body)
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "previous_response_id"
