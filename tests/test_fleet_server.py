"""Two chat models and an embedding model behind one real server, with the official openai
and anthropic clients: requests by name and by alias, a model loaded on first use and
another unloaded (least recently used) when a third needs the memory of a small budget,
`/v1/models` states, admin load and unload, and each error naming the field."""

from __future__ import annotations

import argparse
import json

import anthropic
import httpx
import numpy as np
import openai
import pytest
from embedding_models import build_embedding_model
from lora_files import save_peft_adapter
from server_helpers import running_app
from tiny_models import build_tiny_model
from tiny_server import CHAT_TEMPLATE

from server.fleet.args import model_catalog
from server.fleet.front import build_fleet_app
from server.fleet.serve import fleet_of
from server.launch import _http_options, add_arguments

TOOLS_TEMPLATE = "{% if tools %}w9 {% endif %}" + CHAT_TEMPLATE
# A request each capability serves: its route and body.
SERVING_REQUESTS = {"completion": ("completions", {"prompt": "w5 w6", "max_tokens": 2}),
                    "embeddings": ("embeddings", {"input": "w5 w6"}),
                    "rerank": ("rerank", {"query": "w5", "documents": ["w6 w7", "w8"]})}
# What a model's first load may take: with a cold numba cache (a fresh checkout, CI) it
# compiles the CPU kernels, minutes on a small machine.
LOAD_S = 600
# Each model: 16 MiB of KV and well under 1 MiB of weights; two fit in the budget, not three.
KV = "16MiB"
BUDGET = "40MiB"


@pytest.fixture(scope="module")
def fleet_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    # `coder`'s chat template takes tools, `small`'s does not.
    for name, layers, template in (("coder", 2, TOOLS_TEMPLATE), ("small", 1, CHAT_TEMPLATE)):
        base = build_tiny_model("llama", root / name, num_hidden_layers=layers)
        (root / name / "tokenizer_config.json").write_text(
            json.dumps({"chat_template": template}))
    save_peft_adapter(base, root / "small-ft", rank=4, seed=1)
    build_embedding_model(root / "embed")
    # `small` through the config file: its alias, and an adapter in its own options.
    config = root / "models.toml"
    config.write_text('[models.small]\npath = "small"\naliases = ["claude-*-haiku-*"]\n'
                      f'options = ["--lora-modules", "small-ft={root / "small-ft"}"]\n')
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([
        "--model", f"coder={root / 'coder'}", "--models-config", str(config),
        "--model", f"embed={root / 'embed'}", "--pin", "coder",
        "--alias", "text-embedding-*=embed", "--alias", "claude-sonnet-*=coder",
        "--kv-cache-memory", KV, "--max-model-len", "128", "--models-memory", BUDGET,
    ])  # fmt: skip
    catalog = model_catalog(args)
    fleet = fleet_of(catalog, args, _http_options(args))
    with running_app(build_fleet_app(fleet, _http_options(args), ("coder",)),
                     start_timeout_s=LOAD_S) as url:
        yield url


def states(client: openai.OpenAI) -> dict[str, str]:
    return {card.id: card.state for card in client.models.list().data if card.parent is None}


def chat(client: openai.OpenAI, model: str) -> str:
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "w3 w4"}], max_tokens=4,
        temperature=0)
    return reply.model


def test_models_load_on_first_use_by_name_and_alias_and_the_lru_one_makes_room(fleet_server):
    client = openai.OpenAI(base_url=f"{fleet_server}/v1", api_key="none")
    cards = {card.id: card for card in client.models.list().data}
    assert states(client) == {"coder": "loaded", "small": "unloaded", "embed": "unloaded"}
    assert list(cards) == ["coder", "embed", "small"]  # --model flags, then the file
    assert cards["small"].max_model_len == 256  # its trained context, read from its files
    assert cards["small"].aliases == ["claude-*-haiku-*", "small-ft"]
    assert cards["embed"].capabilities == ["embeddings"]
    assert cards["small"].capabilities == ["completion", "chat"]  # read from its files
    assert cards["coder"].capabilities == ["completion", "chat", "tools"]  # its engine's

    assert chat(client, "coder") == "coder"
    assert chat(client, "claude-sonnet-4-5") == "coder"
    assert chat(client, "claude-3-5-haiku-20241022") == "small"  # loaded for it
    assert states(client) == {"coder": "loaded", "small": "loaded", "embed": "unloaded"}

    # The budget holds two: the embedding model takes the room of `small` (idle, unpinned).
    embedded = client.embeddings.create(model="text-embedding-3-small", input=["w5 w6", "w7"])
    assert [len(item.embedding) for item in embedded.data] == [64, 64]
    by_name = client.embeddings.create(model="embed", input="w5 w6")
    assert by_name.model == "embed"
    np.testing.assert_allclose(by_name.data[0].embedding, embedded.data[0].embedding, atol=1e-5)
    assert states(client) == {"coder": "loaded", "small": "unloaded", "embed": "loaded"}
    cards = {card.id: card for card in client.models.list().data}
    assert cards["embed"].max_model_len == 128 and cards["coder"].num_parameters > 0
    assert cards["embed"].capabilities == ["embeddings"]

    # And back: `small` loads again, `embed` (least recently used, unpinned) makes room.
    assert chat(client, "small") == "small"
    assert states(client) == {"coder": "loaded", "small": "loaded", "embed": "unloaded"}
    metrics = httpx.get(f"{fleet_server}/metrics").text
    assert 'metal_serve_model_loaded{model_name="embed"} 0.0' in metrics
    assert 'metal_serve_model_loads{model_name="small"} 2.0' in metrics
    assert 'vllm:num_requests_running{engine="0",model_name="coder"}' in metrics


def test_an_adapter_named_in_a_models_options_picks_that_model(fleet_server):
    client = openai.OpenAI(base_url=f"{fleet_server}/v1", api_key="none")
    assert chat(client, "small-ft") == "small-ft"
    cards = {card.id: card for card in client.models.list().data}
    assert cards["small-ft"].parent == "small" and cards["small"].state == "loaded"


def test_an_unknown_model_is_a_404_in_each_apis_error_shape(fleet_server):
    client = openai.OpenAI(base_url=f"{fleet_server}/v1", api_key="none")
    with pytest.raises(openai.NotFoundError) as refused:
        chat(client, "gpt-4o")
    error = refused.value.body
    assert error["param"] == "model" and error["code"] == "model_not_found"
    assert "it serves coder, embed, small" in error["message"]
    claude = anthropic.Anthropic(base_url=fleet_server, api_key="none")
    with pytest.raises(anthropic.NotFoundError) as refused:
        claude.messages.create(model="claude-opus-4", max_tokens=4,
                               messages=[{"role": "user", "content": "w3"}])
    assert refused.value.body["type"] == "error"
    assert "claude-opus-4" in refused.value.body["error"]["message"]


def test_admin_load_and_unload_by_name(fleet_server):
    unloaded = httpx.post(f"{fleet_server}/v1/models/unload", json={"model": "small"})
    assert unloaded.status_code == 200 and unloaded.json()["state"] == "unloaded"
    loaded = httpx.post(f"{fleet_server}/v1/models/load", json={"model": "small"})
    assert loaded.status_code == 200 and loaded.json()["state"] == "loaded"
    unknown = httpx.post(f"{fleet_server}/v1/models/load", json={"model": "nope"})
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"
    missing = httpx.post(f"{fleet_server}/v1/models/load", json={})
    assert missing.status_code == 400 and "model" in missing.json()["error"]["message"]


def test_a_dashboard_state_per_model(fleet_server):
    coder = httpx.get(f"{fleet_server}/dashboard/state", params={"model": "coder"}).json()
    assert coder["model"]["served_name"] == "coder"


def test_status_shows_one_model_of_several(fleet_server, capsys):
    from server.cli import main

    assert main(["status", "--url", fleet_server, "--model", "coder"]) == 0
    assert "coder" in capsys.readouterr().out
    assert main(["status", "--url", fleet_server, "--model", "gpt-9"]) == 1
    assert "serves no model 'gpt-9'" in capsys.readouterr().err


def test_a_models_card_lists_before_it_loads_what_its_engine_serves(tmp_path):
    """Each unloaded card's capabilities, read from the model's files and its options'
    `--task`, equal its loaded engine's: chat with tools (the template in
    chat_template.jinja), a cross-encoder and a causal reranker (`--task rerank` in its
    options) that rerank, the same causal LM without that option, and an embedding model
    without an LM head or sentence-transformers files."""
    from embedding_models import build_reranker
    from encoder_models import build_cross_encoder

    build_tiny_model("llama", tmp_path / "tools")
    (tmp_path / "tools" / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    build_cross_encoder("bert", tmp_path / "cross")
    build_reranker(tmp_path / "qwen-reranker")
    build_embedding_model(tmp_path / "headless")
    (tmp_path / "headless" / "modules.json").unlink()  # nothing says it embeds but its head
    config = tmp_path / "models.toml"
    config.write_text('[models.reranker]\npath = "qwen-reranker"\n'
                      'options = ["--task", "rerank"]\n')
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([
        "--model", f"tools={tmp_path / 'tools'}", "--model", f"cross={tmp_path / 'cross'}",
        "--model", f"generator={tmp_path / 'qwen-reranker'}", "--models-config", str(config),
        "--model", f"headless={tmp_path / 'headless'}", "--kv-cache-memory", "4MiB",
        "--max-model-len", "64", "--max-loaded-models", "1",
    ])  # fmt: skip
    expected = {"tools": ["completion", "chat", "tools"], "cross": ["rerank"],
                "generator": ["completion"], "headless": ["embeddings"],
                "reranker": ["rerank"]}
    fleet = fleet_of(model_catalog(args), args, _http_options(args))
    with running_app(build_fleet_app(fleet, _http_options(args))) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        unloaded = {card.id: card.capabilities for card in client.models.list().data}
        assert unloaded == expected
        for name in expected:
            card = httpx.post(f"{url}/v1/models/load", json={"model": name}, timeout=LOAD_S)
            assert card.status_code == 200, card.text
            assert (card.json()["state"], card.json()["capabilities"]) == ("loaded",
                                                                          expected[name])
            route, body = SERVING_REQUESTS[expected[name][0]]
            served = httpx.post(f"{url}/v1/{route}", json={"model": name, **body},
                                timeout=LOAD_S)
            assert served.status_code == 200, served.text


def test_with_an_api_key_the_model_list_and_the_admin_endpoints_need_it(tmp_path):
    build_tiny_model("llama", tmp_path / "solo")
    (tmp_path / "solo" / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": CHAT_TEMPLATE}))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", f"solo={tmp_path / 'solo'}", "--api-key", "s3cret",
                              "--kv-cache-memory", "4MiB", "--max-model-len", "64"])
    options = _http_options(args)
    with running_app(build_fleet_app(fleet_of(model_catalog(args), args, options),
                                     options)) as url:
        stranger = openai.OpenAI(base_url=f"{url}/v1", api_key="wrong")
        with pytest.raises(openai.AuthenticationError):
            stranger.models.list()
        with pytest.raises(openai.AuthenticationError):
            chat(stranger, "solo")
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret")
        assert states(client) == {"solo": "unloaded"}  # a request without the key loads nothing
        key = {"Authorization": "Bearer s3cret"}
        for action, state in (("load", "loaded"), ("unload", "unloaded")):
            refused = httpx.post(f"{url}/v1/models/{action}", json={"model": "solo"})
            assert refused.status_code == 401, refused.text
            assert states(client) == {"solo": "unloaded" if action == "load" else "loaded"}
            done = httpx.post(f"{url}/v1/models/{action}", json={"model": "solo"},
                              headers=key, timeout=LOAD_S)
            assert (done.status_code, done.json()["state"]) == (200, state)
        assert httpx.get(f"{url}/v1/models").status_code == 401
