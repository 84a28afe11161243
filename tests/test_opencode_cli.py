"""opencode (`opencode run`, the pinned version) end to end against a real `metal-serve` app on
a port, as an `@ai-sdk/openai-compatible` provider (chat completions): a scripted model calls
opencode's write tool, opencode writes the file and sends the result back, and the turn ends
with the text it prints; and one plain turn on the default model. opencode also asks for a
title in a side request, at its own time; the scripted model answers that one apart."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from cli_clients import cli_env, cli_path, run_cli
from fake_engine import ReplyingEngine, ToolTemplateTokenizer, hermes_call, tool_results
from server_helpers import running_app, running_server, small_engine

from server.app import build_app
from server.async_engine import AsyncEngine
from server.sampling_defaults import SamplingDefaults

OPENCODE_TIMEOUT_S = 180
FINAL_TEXT = "I wrote hello.txt for you."
TITLE = "Greeting file"
CONTENT = "Hello from the model.\n"
BIG_CONTEXT = 1 << 17  # opencode's prompt is ~40k characters, a token each here
# Nothing fetched at run time but what opencode installs from npm into its config dir.
QUIET = {
    "OPENCODE_DISABLE_AUTOUPDATE": "1", "OPENCODE_DISABLE_MODELS_FETCH": "1",
    "OPENCODE_DISABLE_LSP_DOWNLOAD": "1", "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1",
    "NO_COLOR": "1",
}  # fmt: skip


def opencode_config(url: str, **extra) -> dict:
    """The server as the only provider, every edit allowed (no one is there to approve; a
    work dir outside a git repository counts as an external directory). opencode bundles
    the provider package: the bare name loads it, a versioned one would come from npm."""
    provider = {
        "npm": "@ai-sdk/openai-compatible", "name": "metal-serve",
        "options": {"baseURL": f"{url}/v1", "apiKey": "local"},
        "models": {"default": {"name": "default"}},
    }  # fmt: skip
    return {
        "$schema": "https://opencode.ai/config.json", "provider": {"metal": provider},
        "model": "metal/default", "small_model": "metal/default", "autoupdate": False,
        "share": "disabled", "permission": {"edit": "allow", "external_directory": "allow"},
        **extra,
    }  # fmt: skip


def run_opencode(
    tmp_path: Path, config: dict, prompt: str, **more_env: str
) -> subprocess.CompletedProcess:
    """`opencode run` in an empty work dir under `tmp_path`, its config, data and cache
    there too."""
    home, work = tmp_path / "home", tmp_path / "work"
    (home / ".config" / "opencode").mkdir(parents=True)
    (home / ".config" / "opencode" / "opencode.json").write_text(json.dumps(config))
    work.mkdir(exist_ok=True)
    env = cli_env(
        **QUIET, HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"),
        XDG_DATA_HOME=str(home / ".local" / "share"), XDG_CACHE_HOME=str(home / ".cache"),
        XDG_STATE_HOME=str(home / ".local" / "state"), **more_env,
    )  # fmt: skip
    return run_cli([str(cli_path("opencode")), "run", prompt], env, work, OPENCODE_TIMEOUT_S)


def test_opencode_writes_a_file_through_its_write_tool(tmp_path):
    target = tmp_path.resolve() / "work" / "hello.txt"

    def reply(prompt: str) -> list[str]:
        if "You are a title generator" in prompt:
            return [TITLE]
        if tool_results(prompt):
            return [FINAL_TEXT]
        call = {"filePath": str(target), "content": CONTENT}
        return ["I will write it. ", *hermes_call("write", call)]

    engine = ReplyingEngine(reply, ToolTemplateTokenizer(), BIG_CONTEXT)
    with running_server(engine) as url:
        result = run_opencode(tmp_path, opencode_config(url), "Write a greeting to hello.txt")
    assert result.returncode == 0, (result.stdout, result.stderr[-3000:])
    assert target.read_text() == CONTENT
    assert FINAL_TEXT in result.stdout, (result.stdout, result.stderr[-3000:])
    answered = [prompt for prompt in engine.prompts.values() if tool_results(prompt)]
    assert answered, list(engine.prompts.values())
    [written] = tool_results(answered[-1])
    assert "error" not in written["content"].lower(), written
    assert '"name": "write"' in answered[-1]  # the call went back before its result


@pytest.mark.slow
def test_opencode_answers_on_the_default_model(tmp_path, default_model_dir):
    """opencode's own prompt (~10k tokens of instructions and tools) would overflow the
    default model's context: a one-line agent prompt and no tools make it ~150 tokens. Its
    max_tokens is the model's output limit (32000 unless set): 128 keeps the title request
    short on the CPU; without auto-compaction no summary requests follow."""
    small = opencode_config("", tools={"*": False}, instructions=[],
                            agent={"build": {"prompt": "You are a helpful assistant. Answer in "
                                                       "one short sentence."}})  # fmt: skip
    small["provider"]["metal"]["models"]["default"]["limit"] = {"context": 8192, "output": 128}
    engine = AsyncEngine(small_engine(default_model_dir, 1024),
                         sampling_defaults=SamplingDefaults(temperature=0.0))  # fmt: skip
    with running_app(build_app(engine, "default")) as url:
        small["provider"]["metal"]["options"]["baseURL"] = f"{url}/v1"
        result = run_opencode(
            tmp_path, small, "What is the capital of France?", OPENCODE_DISABLE_AUTOCOMPACT="1"
        )
    assert result.returncode == 0, (result.stdout, result.stderr[-3000:])
    assert "Paris" in result.stdout, (result.stdout, result.stderr[-3000:])
