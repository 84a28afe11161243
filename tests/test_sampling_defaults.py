"""Sampling defaults: read from generation_config.json under the server's overrides, and given
to the fields a request leaves unset, on every API; explicit values win."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import pytest
from fake_engine import ScriptedEngine
from server_helpers import running_app

from server.app import build_app
from server.async_engine import AsyncEngine
from server.cli import main
from server.sampling_defaults import SamplingDefaults, load_sampling_defaults, parse_override

# What a Hugging Face generation_config.json holds: sampling keys among others.
HF_GENERATION_CONFIG = {
    "bos_token_id": 1, "eos_token_id": [2, 7], "do_sample": True, "temperature": 0.6,
    "top_p": 0.95, "top_k": 20, "transformers_version": "4.51.0",
}  # fmt: skip
DEFAULTS = SamplingDefaults(temperature=0.2, top_p=0.9, top_k=40, min_p=0.05,
                            repetition_penalty=1.1)
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _folder(tmp_path: Path, name: str, config: dict | None) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    if config is not None:
        (folder / "generation_config.json").write_text(json.dumps(config))
    return folder


def test_auto_reads_the_sampling_keys_of_the_model_dir(tmp_path):
    model = _folder(tmp_path, "model", HF_GENERATION_CONFIG)
    assert load_sampling_defaults(model) == SamplingDefaults(temperature=0.6, top_p=0.95,
                                                             top_k=20)


def test_without_a_file_or_with_vllm_the_defaults_are_neutral(tmp_path):
    assert load_sampling_defaults(_folder(tmp_path, "bare", None)) == SamplingDefaults()
    model = _folder(tmp_path, "model", HF_GENERATION_CONFIG)
    neutral = load_sampling_defaults(model, "vllm")
    assert (neutral.temperature, neutral.top_p, neutral.top_k) == (1.0, 1.0, 0)


def test_a_folder_replaces_the_model_dirs_file(tmp_path):
    model = _folder(tmp_path, "model", HF_GENERATION_CONFIG)
    other = _folder(tmp_path, "other", {"temperature": 0.3, "min_p": 0.1, "top_k": -1})
    assert load_sampling_defaults(model, str(other)) == SamplingDefaults(temperature=0.3,
                                                                         min_p=0.1)
    with pytest.raises(ValueError, match="--generation-config .*does not exist"):
        load_sampling_defaults(model, str(tmp_path / "nowhere"))


def test_the_override_goes_over_what_was_loaded(tmp_path):
    model = _folder(tmp_path, "model", HF_GENERATION_CONFIG)
    merged = load_sampling_defaults(model, "auto", {"temperature": 0.5, "repetition_penalty": 1.2})
    assert merged == SamplingDefaults(temperature=0.5, top_p=0.95, top_k=20,
                                      repetition_penalty=1.2)
    assert load_sampling_defaults(model, "vllm", {"top_p": 0.8}) == SamplingDefaults(top_p=0.8)


@pytest.mark.parametrize(
    ("config", "message"),
    [({"temperature": "hot"}, "temperature must be a number"),
     ({"top_p": 0}, "top_p must be in"),
     ({"top_k": 2.5}, "top_k must be an integer"),
     ([1, 2], "generation_config.json")],
)
def test_a_bad_file_names_itself_and_the_way_out(tmp_path, config, message):
    model = _folder(tmp_path, "model", config)
    with pytest.raises(ValueError, match=message) as error:
        load_sampling_defaults(model)
    assert "--generation-config vllm" in str(error.value)


@pytest.mark.parametrize(
    ("text", "message"),
    [("{temperature: 1}", "not valid JSON"),
     ("[0.5]", "expected a JSON object"),
     ('{"temp": 0.5}', "unknown keys temp"),
     ('{"temperature": -1}', "temperature must be >= 0"),
     ('{"temperature": Infinity}', "temperature must be a finite number")],
)
def test_bad_overrides_are_refused(text, message):
    with pytest.raises(ValueError, match=message):
        parse_override(text)


@pytest.mark.parametrize("text", ['{"top_k": Infinity}', '{"top_k": 1e999}', '{"top_k": NaN}'])
def test_non_finite_overrides_name_the_key_and_the_flag(text, capsys):
    # Python's JSON reader takes these; int(inf) used to escape as an OverflowError.
    key = json.loads(text).popitem()[0]
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--override-generation-config", text])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--override-generation-config" in err and f"{key} must be a finite number" in err


@pytest.mark.parametrize("text", ['{"top_k": 1e999}', '{"top_k": Infinity}', '{"min_p": NaN}'])
def test_a_non_finite_number_in_the_file_names_the_key_and_the_file(tmp_path, text):
    model = tmp_path / "model"
    model.mkdir()
    (model / "generation_config.json").write_text(text)
    key = json.loads(text).popitem()[0]
    with pytest.raises(ValueError, match=f"{key} must be a finite number") as error:
        load_sampling_defaults(model)
    assert "generation_config.json" in str(error.value)
    assert "--generation-config vllm" in str(error.value)


# ---------------------------------------------------------------- through the real app


@pytest.fixture(scope="module")
def served():
    """(base URL, engine) of an app whose requests get DEFAULTS for unset fields."""
    engine = ScriptedEngine(["ok"])
    app = build_app(AsyncEngine(engine, sampling_defaults=DEFAULTS), "m")
    with running_app(app) as url:
        yield url, engine


ROUTES = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
    "/v1/completions": {"prompt": "hi"},
    "/v1/responses": {"input": "hi"},
    "/v1/messages": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8},
}


def _params_of(served, route: str, fields: dict):
    url, engine = served
    engine.params.clear()
    response = httpx.post(f"{url}{route}", json={"model": "m", **ROUTES[route], **fields})
    assert response.status_code == 200, response.text
    (params,) = engine.params.values()
    return {name: getattr(params, name) for name in SAMPLING}


@pytest.mark.parametrize("route", ROUTES)
def test_unset_fields_get_the_defaults(served, route):
    assert _params_of(served, route, {}) == {name: getattr(DEFAULTS, name) for name in SAMPLING}


@pytest.mark.parametrize(
    ("route", "fields"),
    [("/v1/chat/completions", {"temperature": 0, "top_p": 1, "top_k": -1, "min_p": 0,
                               "repetition_penalty": 1}),
     ("/v1/completions", {"temperature": 1.5, "top_k": 0}),
     ("/v1/responses", {"temperature": 0, "top_p": 1}),
     ("/v1/messages", {"temperature": 1, "top_k": 5})],
)
def test_explicit_values_win(served, route, fields):
    got = _params_of(served, route, fields)
    expected = {name: getattr(DEFAULTS, name) for name in SAMPLING}
    expected.update({name: max(value, 0) for name, value in fields.items()})
    assert got == expected


def test_model_cards_show_the_defaults_and_context(served):
    url, engine = served
    cards = httpx.get(f"{url}/v1/models").json()["data"]
    assert [card["sampling_defaults"]["temperature"] for card in cards] == [0.2, 0.2]
    assert cards[0]["sampling_defaults"]["top_k"] == 40
    assert cards[0]["max_model_len"] == engine.max_model_len


# ---------------------------------------------------------------- output length


def test_max_new_tokens_comes_from_the_generation_config_and_the_override(tmp_path):
    model = _folder(tmp_path, "model", {**HF_GENERATION_CONFIG, "max_new_tokens": 256})
    assert load_sampling_defaults(model).max_new_tokens == 256
    assert load_sampling_defaults(model, override={"max_new_tokens": 64}).max_new_tokens == 64
    with pytest.raises(ValueError, match="max_new_tokens must be an integer"):
        parse_override('{"max_new_tokens": 1.5}')


@pytest.mark.parametrize(("default", "limit", "requested", "expected"), [
    (None, None, None, None), (100, None, None, 100), (100, None, 5000, 5000),
    (None, 50, None, 50), (None, 50, 128000, 50), (100, 50, None, 50), (10, 50, 20, 20),
])  # fmt: skip
def test_what_a_request_may_generate(default, limit, requested, expected):
    defaults = SamplingDefaults(max_new_tokens=default, max_tokens_limit=limit)
    assert defaults.max_tokens(requested) == expected


@pytest.fixture(scope="module")
def length_served():
    """(base URL, engine) of an app with a default output length of 7 and a limit of 50."""
    engine = ScriptedEngine(["ok"])
    defaults = SamplingDefaults(max_new_tokens=7, max_tokens_limit=50)
    with running_app(build_app(AsyncEngine(engine, sampling_defaults=defaults), "m")) as url:
        yield url, engine


@pytest.mark.parametrize(("route", "fields", "expected"), [
    ("/v1/chat/completions", {}, 7),
    ("/v1/chat/completions", {"max_tokens": 32000}, 50),  # Qwen Code's
    ("/v1/chat/completions", {"max_completion_tokens": 20}, 20),
    ("/v1/completions", {}, 7),
    ("/v1/responses", {}, 7),  # Codex sends none
    ("/v1/responses", {"max_output_tokens": 128000}, 50),
    ("/v1/messages", {"max_tokens": 128000}, 50),  # Claude Code's
])  # fmt: skip
def test_output_length_defaults_and_limit_reach_the_engine(length_served, route, fields,
                                                           expected):
    url, engine = length_served
    engine.params.clear()
    body = {"model": "m", **ROUTES[route], **fields}
    assert httpx.post(f"{url}{route}", json=body).status_code == 200
    (params,) = engine.params.values()
    assert params.max_tokens == expected


@pytest.mark.slow
def test_a_request_without_max_tokens_stops_at_the_servers_default(default_model_dir, tmp_path):
    import openai

    from server.bench.server_process import free_port, running_server

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [str(Path(sys.executable).parent / "metal-serve"), "serve", str(default_model_dir),
               "--port", str(port), "--max-model-len", "2048", "--kv-cache-memory", "128MiB",
               "--default-max-tokens", "6"]  # fmt: skip
    with running_server(command, url, tmp_path / "server.log", timeout_s=120):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        answer = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Write a long story about a cat."}])
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage.completion_tokens == 6
