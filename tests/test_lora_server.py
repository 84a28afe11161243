"""LoRA adapters through the server: requests pick one by `model`, /v1/models lists them,
and they load and unload at run time, on a real server over a tiny random Llama."""

from __future__ import annotations

import json
import re
import threading

import anthropic
import httpx
import numpy as np
import openai
import pytest
from lora_files import save_peft_adapter, torch_greedy, write_peft_files
from server_helpers import running_app
from tiny_models import VOCAB, build_tiny_model
from tiny_server import CHAT_TEMPLATE
from tokenizers import Tokenizer, models, pre_tokenizers

from metal_engine.config import EngineConfig
from metal_engine.engine_build import build_engine
from server.app import HttpOptions, build_app
from server.async_engine import AsyncEngine
from server.cli import main

KEY = "sk-lora"
PROMPT = [5, 17, 3, 99, 42, 8, 61, 23, 70, 11, 4, 90]
MAX_RANK = 8
Q = "model.layers.0.self_attn.q_proj"  # the tiny Llama's is 64 x 64
STREAMED = 240  # tokens: a stream that outlasts a load, a request and two unloads


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(base URL, {adapter name: (dir, PEFT model)} with "c" not loaded, base torch model):
    "a" and "b" loaded at start, room for one more."""
    root = tmp_path_factory.mktemp("lora-server")
    model_dir = root / "model"
    base = build_tiny_model("llama", model_dir)
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    adapters = {name: (root / name, save_peft_adapter(base, root / name, rank, seed))
                for name, rank, seed in [("a", 4, 1), ("b", 8, 2), ("c", 4, 3)]}
    modules = (("a", adapters["a"][0]), ("b", adapters["b"][0]))
    engine = build_engine(EngineConfig(
        model_dir=model_dir, max_model_len=256, kv_cache_memory=16 << 20, max_loras=3,
        max_lora_rank=MAX_RANK, lora_modules=modules))
    app = build_app(AsyncEngine(engine, lora_paths=dict(modules)),
                    options=HttpOptions(api_keys=(KEY,)))
    with running_app(app) as url:
        yield url, adapters, base


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served[0]}/v1", api_key=KEY, max_retries=0)


def tokens(text: str) -> list[int]:
    """The word tokenizer's ids back from its text (`w<i>` is token i)."""
    return [int(i) for i in re.findall(r"w(\d+)", text)]


def lora_pair(rank: int, in_features: int, out_features: int):
    return np.ones((rank, in_features)), np.ones((out_features, rank))


def completion_tokens(client, model: str, max_tokens: int = 6) -> list[int]:
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens,
                                    temperature=0)
    return tokens(out.choices[0].text)


def post(served, path: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{served[0]}/v1/{path}", json=body, headers=headers, timeout=60)


def test_requests_pick_adapters_by_model_and_get_peft_tokens(served, client):
    _, adapters, base = served
    for name in ("a", "b"):
        assert completion_tokens(client, name) == torch_greedy(adapters[name][1], PROMPT, 6)
    base_tokens = torch_greedy(base, PROMPT, 6)
    assert completion_tokens(client, "default") == base_tokens
    assert completion_tokens(client, "any-other-name") == base_tokens


def test_chat_responses_and_messages_serve_the_named_adapter(served, client):
    url, _, _ = served
    messages = [{"role": "user", "content": "w5 w17 w3 w99 w42"}]

    def chat(model: str) -> tuple[str, str]:
        out = client.chat.completions.create(model=model, messages=messages, max_tokens=6,
                                             temperature=0)
        return out.model, out.choices[0].message.content

    assert chat("a")[0] == "a" and chat("some-model")[0] == "default"
    assert chat("a")[1] != chat("b")[1] != chat("default")[1]
    response = client.responses.create(model="a", input=messages, max_output_tokens=6,
                                       temperature=0)
    assert (response.model, response.output_text) == chat("a")
    message = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0).messages.create(
        model="b", messages=messages, max_tokens=6, extra_body={"temperature": 0})
    assert (message.model, message.content[0].text) == chat("b")


def test_models_lists_each_adapter_with_its_parent(served, client):
    _, adapters, _ = served
    cards = {card.id: card for card in client.models.list().data}
    assert {"a", "b"} <= set(cards) and "c" not in cards
    for name in ("a", "b"):
        assert cards[name].parent == "default"
        assert cards[name].root == str(adapters[name][0])
    assert cards["default"].parent is None


def model_ids(client) -> set[str]:
    return {card.id for card in client.models.list().data}


def test_adapters_load_and_unload_while_another_streams(served, client):
    """"c" loads, serves and unloads between the steps of a stream served by "a", which
    meanwhile cannot be unloaded; the stream's tokens are "a"'s throughout."""
    _, adapters, base = served
    want = {"a": torch_greedy(adapters["a"][1], PROMPT, STREAMED),  # not beside the stream
            "c": torch_greedy(adapters["c"][1], PROMPT, 6), "base": torch_greedy(base, PROMPT, 6)}
    streamed, first, done = [], threading.Event(), threading.Event()

    def stream() -> None:
        chunks = client.completions.create(model="a", prompt=PROMPT, max_tokens=STREAMED,
                                           temperature=0, stream=True)
        for chunk in chunks:
            streamed.append(chunk.choices[0].text if chunk.choices else "")
            first.set()
        done.set()

    thread = threading.Thread(target=stream)
    thread.start()
    assert first.wait(60)
    loaded = post(served, "load_lora_adapter", {"lora_name": "c",
                                                 "lora_path": str(adapters["c"][0])})
    assert loaded.status_code == 200 and "'c'" in loaded.text
    assert not done.is_set()  # loaded between two of the stream's steps
    assert completion_tokens(client, "c") == want["c"]
    assert "c" in model_ids(client)
    unloaded = post(served, "unload_lora_adapter", {"lora_name": "c"})
    in_use = post(served, "unload_lora_adapter", {"lora_name": "a"})
    assert not done.is_set()  # both answered while the stream's request is unfinished
    assert unloaded.status_code == 200 and "'c'" in unloaded.text
    assert in_use.status_code == 400
    assert "'a' serves 1 unfinished request" in in_use.json()["error"]["message"]
    assert model_ids(client) >= {"a", "b"} and "c" not in model_ids(client)
    # An unloaded adapter's name is one more name for the base model, like any unknown one.
    assert completion_tokens(client, "c") == want["base"]
    thread.join(60)
    assert done.is_set()
    assert tokens("".join(streamed)) == want["a"]


def test_bad_loads_are_400s_naming_why_and_the_server_goes_on(served, client, tmp_path):
    _, adapters, _ = served
    high_rank = write_peft_files(tmp_path / "r16", {Q: lora_pair(16, 64, 64)}, 16)
    other_base = write_peft_files(tmp_path / "other", {Q: lora_pair(4, 32, 64)}, 4)
    corrupt = write_peft_files(tmp_path / "corrupt", {Q: lora_pair(4, 64, 64)}, 4)
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00not a header")
    cases = [
        ({"lora_name": "x"}, "lora_path"),
        ({"lora_name": "x", "lora_path": str(tmp_path / "nowhere")}, "does not exist"),
        ({"lora_name": "x", "lora_path": str(high_rank)}, "over --max-lora-rank 8"),
        ({"lora_name": "x", "lora_path": str(other_base)}, "an adapter of another base"),
        ({"lora_name": "x", "lora_path": str(corrupt)}, "corrupt"),
        ({"lora_name": "a", "lora_path": str(adapters["a"][0])}, "already loaded"),
        ({"lora_name": "default", "lora_path": str(adapters["c"][0])}, "base model's name"),
    ]
    for body, reason in cases:
        answer = post(served, "load_lora_adapter", body)
        assert answer.status_code == 400, body
        assert reason in answer.json()["error"]["message"], answer.json()
    unload = post(served, "unload_lora_adapter", {"lora_name": "x"})
    assert unload.status_code == 400 and "no LoRA adapter named 'x'" in unload.text
    assert "x" not in {card.id for card in client.models.list().data}
    assert completion_tokens(client, "a") == torch_greedy(adapters["a"][1], PROMPT, 6)


def test_loading_needs_the_api_key(served):
    body = {"lora_name": "c", "lora_path": str(served[1]["c"][0])}
    assert post(served, "load_lora_adapter", body, key=None).status_code == 401
    assert post(served, "unload_lora_adapter", {"lora_name": "a"}, key="wrong").status_code == 401


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([], ((), None, None)),
        (["--lora-modules", "a=/x/a", "b=/x/b", "--max-loras", "4", "--max-lora-rank", "32"],
         ((("a", "/x/a"), ("b", "/x/b")), 4, 32)),
        (["--lora-modules", '{"name": "j", "path": "/x/j", "base_model_name": "m"}',
          "--lora-modules", "k=/x/k"], ((("j", "/x/j"), ("k", "/x/k")), None, None)),
    ],
)
def test_lora_flags_reach_the_engine_config(tmp_path, monkeypatch, argv, expected):
    from metal_engine import engine_build

    seen = []
    monkeypatch.setattr(engine_build, "build_engine", (
        lambda config: seen.append(config) or (_ for _ in ()).throw(ValueError("stop here"))))
    assert main(["serve", str(tmp_path), *argv]) == 2
    modules, max_loras, max_rank = expected
    config = seen[0]
    assert tuple((name, str(path)) for name, path in config.lora_modules) == modules
    assert config.max_loras == (max_loras if max_loras is not None else 0)
    assert config.max_lora_rank == (max_rank if max_rank is not None else 16)


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--lora-modules", "no-path"], "--lora-modules"),
        (["--lora-modules", "=/x"], "--lora-modules"),
        (["--lora-modules", '{"name": "j"}'], "--lora-modules"),
        (["--lora-modules", "a=/x", "a=/y"], "--lora-modules"),
        (["--max-loras", "-1"], "--max-loras"),
        (["--max-lora-rank", "0"], "--max-lora-rank"),
    ],
)
def test_bad_lora_flags_exit_2_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err and flag in err


def test_more_adapters_than_max_loras_exit_2(tmp_path, capsys):
    assert main(["serve", str(tmp_path), "--lora-modules", "a=/x", "b=/y",
                 "--max-loras", "1"]) == 2
    assert "--max-loras" in capsys.readouterr().err
