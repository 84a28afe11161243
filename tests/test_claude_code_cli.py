"""Claude Code (`claude -p`, the pinned version) end to end against a real `metal-serve` app on
a port, through `ANTHROPIC_BASE_URL`: a scripted model calls Claude Code's Write tool, Claude
Code writes the file and sends the result back, and the turn ends with the text it prints;
and one plain turn on the default model. Claude Code asks for max_tokens 128000 each time:
the server caps it at what the context has left."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from cli_clients import cli_env, cli_path, run_cli
from fake_engine import ReplyingEngine, ToolTemplateTokenizer, hermes_call, tool_results
from server_helpers import running_app, running_server, small_engine

from metal_engine.loading.parameter_count import ParameterCount
from server.app import build_app, model_app
from server.async_engine import AsyncEngine
from server.fleet.catalog import ModelCatalog, ModelEntry
from server.fleet.fleet import ModelFleet, Planned
from server.fleet.front import ServedModel, build_fleet_app
from server.sampling_defaults import SamplingDefaults

CLAUDE_TIMEOUT_S = 180
FINAL_TEXT = "I wrote hello.txt for you."
CONTENT = "Hello from the model.\n"
# Claude Code's own prompt is ~50k characters (one token each for the test tokenizer).
BIG_CONTEXT = 1 << 17
# Nothing that phones home: telemetry, error reports, update checks, other side traffic.
QUIET = {
    "DISABLE_TELEMETRY": "1", "DISABLE_ERROR_REPORTING": "1", "DISABLE_AUTOUPDATER": "1",
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "NO_COLOR": "1",
}  # fmt: skip


def run_claude(tmp_path: Path, url: str, prompt: str, *flags: str) -> subprocess.CompletedProcess:
    """`claude -p` in an empty work dir under `tmp_path`, with its home there too and only
    this server to talk to (the caller's own Claude Code settings stay out)."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir(exist_ok=True)
    env = cli_env(**QUIET, HOME=str(home), ANTHROPIC_BASE_URL=url, ANTHROPIC_API_KEY="local")
    return run_cli([str(cli_path("claude")), "-p", prompt, *flags], env, work, CLAUDE_TIMEOUT_S)


def test_claude_code_writes_a_file_through_its_write_tool(tmp_path):
    target = tmp_path.resolve() / "work" / "hello.txt"

    def reply(prompt: str) -> list[str]:
        # Side requests (if any) without tools get the call as plain text, which they ignore.
        if tool_results(prompt):
            return [FINAL_TEXT]
        return ["I will write it. ", *hermes_call("Write", {"file_path": str(target),
                                                             "content": CONTENT})]

    engine = ReplyingEngine(reply, ToolTemplateTokenizer(), BIG_CONTEXT)
    with running_server(engine) as url:
        result = run_claude(
            tmp_path, url, "Write a greeting to hello.txt",
            # Unattended: edits are accepted and Write is allowed without a prompt.
            "--permission-mode", "acceptEdits", "--allowedTools", "Write",
        )  # fmt: skip
    assert result.returncode == 0, (result.stdout, result.stderr[-3000:])
    assert target.read_text() == CONTENT
    assert FINAL_TEXT in result.stdout
    answered = [engine.prompts[rid] for rid in answered_ids(engine)]
    assert answered, list(engine.prompts.values())
    [written] = tool_results(answered[-1])
    assert "hello.txt" in written["content"] and not written["content"].startswith("Error")
    # The call went back as Claude Code received it, before its result.
    assert '"name": "Write"' in answered[-1]
    # Claude Code asked for 128000 tokens each time; the server capped them to the context.
    room = {rid: BIG_CONTEXT - len(prompt) for rid, prompt in engine.prompts.items()}
    assert all(room[rid] < 128000 for rid in answered_ids(engine))
    assert {rid: p.max_tokens for rid, p in engine.params.items()} == {
        rid: min(128000, left) for rid, left in room.items()
    }


# A project subagent on Claude Code's "haiku" model: its requests name a Haiku model id.
SCOUT_AGENT = """---
name: scout
description: Looks around the work dir quickly
model: haiku
---
You list files.
"""


def test_claude_code_on_two_models_sends_its_haiku_subagent_to_the_aliased_small_one(tmp_path):
    """A server of two models: Claude Code's main turns name its main (Opus) model, which
    `claude-*` sends to "large"; its Haiku subagent's name matches `claude-*haiku*` first
    and goes to "small", loaded on that first use."""

    def main_turn(prompt: str) -> list[str]:
        if tool_results(prompt):
            return [FINAL_TEXT]
        return hermes_call("Agent", {"description": "Look around", "subagent_type": "scout",
                                     "prompt": "List the files here."})

    engines = {"small": ReplyingEngine(lambda prompt: ["No files."], ToolTemplateTokenizer(),
                                       BIG_CONTEXT),
               "large": ReplyingEngine(main_turn, ToolTemplateTokenizer(), BIG_CONTEXT)}
    models = ModelCatalog({"small": ModelEntry("small", None, aliases=("claude-*haiku*",)),
                           "large": ModelEntry("large", None, aliases=("claude-*",))})

    def load(entry: ModelEntry, planned: Planned) -> ServedModel:
        bridge = AsyncEngine(engines[entry.name])
        return ServedModel(bridge, model_app(bridge, entry.name), ParameterCount(0, 0))

    fleet = ModelFleet(models, 1 << 30, lambda entry: Planned(0), load,
                       lambda served: served.bridge.shutdown())
    agents = tmp_path / "work" / ".claude" / "agents"
    agents.mkdir(parents=True)
    (agents / "scout.md").write_text(SCOUT_AGENT)
    with running_app(build_fleet_app(fleet)) as url:
        result = run_claude(tmp_path, url, "Find the files")
    assert result.returncode == 0, (result.stdout, result.stderr[-3000:])
    assert FINAL_TEXT in result.stdout
    [side] = engines["small"].prompts.values()
    assert "List the files here." in side and "Claude Haiku" in side
    main = list(engines["large"].prompts.values())
    assert "Find the files" in main[0] and all("Claude Opus" in prompt for prompt in main)


def answered_ids(engine: ReplyingEngine) -> list[str]:
    return [rid for rid, prompt in engine.prompts.items() if tool_results(prompt)]


# Claude Code's default first prompt (~12.6k tokens of instructions and 12 tools) is longer
# than the default model's context (8192): --bare, a one-line system prompt and no tools make
# it under 100 tokens.
SMALL_PROMPT = ("--bare", "--system-prompt", "You are a helpful assistant. Answer in one short "
                "sentence.", "--tools", "")  # fmt: skip


@pytest.mark.slow
def test_claude_code_answers_on_the_default_model(tmp_path, default_model_dir):
    """Greedy server defaults (Claude Code sends no temperature) make the answer the same
    each run; its 128000 max_tokens is capped at the 1024-token context."""
    engine = AsyncEngine(small_engine(default_model_dir, 1024),
                         sampling_defaults=SamplingDefaults(temperature=0.0))  # fmt: skip
    with running_app(build_app(engine, "default")) as url:
        result = run_claude(tmp_path, url, "What is the capital of France?", *SMALL_PROMPT)
    assert result.returncode == 0, (result.stdout, result.stderr[-3000:])
    assert "Paris" in result.stdout, (result.stdout, result.stderr[-3000:])
