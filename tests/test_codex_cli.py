"""Codex CLI (`codex exec`, the pinned version) end to end against a real `metal-serve` app on a
port, as a model provider with `wire_api = "responses"`: a scripted model makes the calls
that Codex runs (a shell command, a namespaced tool, its apply_patch custom tool) and Codex
sends the results back; and one plain turn on the default model."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from cli_clients import cli_env, cli_path, run_cli
from fake_engine import ReplyingEngine, ToolTemplateTokenizer, hermes_call, tool_results
from server_helpers import running_app, small_engine

from server.app import build_app
from server.async_engine import AsyncEngine
from server.sampling_defaults import SamplingDefaults

CODEX_TIMEOUT_S = 120
FINAL_TEXT = "I wrote the file for you."
THOUGHT = "The shell tool can write it with printf."
PATCH = "*** Begin Patch\n*** Add File: note.txt\n+patched by the model\n*** End Patch\n"


def codex_config(url: str, model: str, extra: str = "") -> str:
    """A config.toml with the server as the only provider, and nothing that phones home."""
    return f"""
model_provider = "metal"
model = "{model}"
check_for_update_on_startup = false
{extra}

[model_providers.metal]
name = "metal-serve"
base_url = "{url}/v1"
wire_api = "responses"
env_key = "METAL_SERVE_API_KEY"

[analytics]
enabled = false
"""


def run_codex(tmp_path: Path, config: str, prompt: str) -> subprocess.CompletedProcess:
    """`codex exec` in an empty work dir under `tmp_path`, unattended (no approvals, no
    sandbox: the commands run in that dir), with its home under `tmp_path` too."""
    home, work = tmp_path / "codex-home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    (home / "config.toml").write_text(config)
    env = cli_env(CODEX_HOME=str(home), HOME=str(tmp_path), METAL_SERVE_API_KEY="local",
                  NO_COLOR="1")  # fmt: skip
    command = [
        str(cli_path("codex")), "exec", "--skip-git-repo-check", "--color", "never",
        "--dangerously-bypass-approvals-and-sandbox", "-C", str(work), prompt,
    ]  # fmt: skip
    return run_cli(command, env, work, CODEX_TIMEOUT_S)


class BodyRecorder:
    """ASGI middleware around the app that keeps the JSON body of each `/v1/responses`
    request (what Codex sent, before the server translated it) and the status it got."""

    def __init__(self, app) -> None:
        self.app = app
        self.bodies: list[dict] = []
        self.statuses: list[int] = []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] != "/v1/responses":
            return await self.app(scope, receive, send)
        chunks: list[bytes] = []

        async def recording_receive():
            message = await receive()
            if message["type"] == "http.request":
                chunks.append(message.get("body", b""))
                if not message.get("more_body"):
                    self.bodies.append(json.loads(b"".join(chunks)))
            return message

        async def recording_send(message):
            if message["type"] == "http.response.start":
                self.statuses.append(message["status"])
            return await send(message)

        return await self.app(scope, recording_receive, recording_send)


def shell_then_namespace(prompt: str) -> list[str]:
    """Think, write a file with Codex's shell tool, then call a namespaced tool, then answer."""
    done = len(tool_results(prompt))
    if done == 0:
        shell = {"cmd": "printf hello > out.txt"}
        return ["<think>", THOUGHT, "</think>", "I will write it. ",
                *hermes_call("exec_command", shell)]  # fmt: skip
    if done == 1:
        return hermes_call("multi_agent_v1.close_agent", {"target": "nobody"})
    return [FINAL_TEXT]


def test_codex_runs_a_shell_call_and_a_namespaced_call(tmp_path):
    engine = ReplyingEngine(shell_then_namespace, ToolTemplateTokenizer(), max_model_len=1 << 17)
    recorder = BodyRecorder(build_app(AsyncEngine(engine), "default"))
    with running_app(recorder) as url:
        result = run_codex(tmp_path, codex_config(url, "default"), "Write hello to out.txt")
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "work" / "out.txt").read_text() == "hello"
    assert FINAL_TEXT in result.stdout
    prompts = list(engine.prompts.values())
    assert len(prompts) == 3, result.stderr[-3000:]
    # Codex sent each call back (the namespaced one with its namespace) with its result.
    last = prompts[-1]
    assert '"name": "multi_agent_v1.close_agent"' in last
    # Codex sent our reasoning item back, and the namespaced call with its namespace.
    sent_back = recorder.bodies[-1]["input"]
    [reasoning] = [item for item in sent_back if item["type"] == "reasoning"]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": THOUGHT}]
    assert reasoning["encrypted_content"] is None
    calls = [(i["name"], i.get("namespace")) for i in sent_back if i["type"] == "function_call"]
    assert calls == [("exec_command", None), ("close_agent", "multi_agent_v1")]
    assert all(THOUGHT not in prompt for prompt in prompts[1:])  # the reasoning stays out
    [shell, namespaced] = tool_results(last)
    assert "exited with code 0" in shell["content"]
    # Codex routed it to its tool, which read the arguments (a joined name is unsupported).
    assert "nobody" in namespaced["content"] and "unsupported call" not in namespaced["content"]


def patch_then_answer(prompt: str) -> list[str]:
    if not tool_results(prompt):
        return ["Patching. ", *hermes_call("apply_patch", {"input": PATCH})]
    return [FINAL_TEXT]


def test_codex_applies_a_patch_through_its_custom_tool(tmp_path):
    """For gpt-5.5 Codex offers apply_patch as a custom tool with a lark grammar."""
    engine = ReplyingEngine(patch_then_answer, ToolTemplateTokenizer(), max_model_len=1 << 17)
    recorder = BodyRecorder(build_app(AsyncEngine(engine), "default"))
    with running_app(recorder) as url:
        result = run_codex(tmp_path, codex_config(url, "gpt-5.5"), "Add note.txt")
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "work" / "note.txt").read_text() == "patched by the model\n"
    assert FINAL_TEXT in result.stdout
    [patch_result] = tool_results(list(engine.prompts.values())[-1])
    assert "note.txt" in patch_result["content"]
    first, *_, last = recorder.bodies
    assert {"type": "custom", "name": "apply_patch"}.items() <= next(
        tool for tool in first["tools"] if tool["name"] == "apply_patch"
    ).items()
    [call] = [item for item in last["input"] if item["type"] == "custom_tool_call"]
    assert (call["name"], call["input"]) == ("apply_patch", PATCH)
    kinds = [item["type"] for item in last["input"]]
    assert kinds[-2:] == ["custom_tool_call", "custom_tool_call_output"]


# Codex's own prompt (~10k tokens of instructions and tools) is longer than the default
# model's context (8192): a short instructions file and fewer tools make it about 500.
SMALL_PROMPT = """
model_instructions_file = "{instructions}"
include_apps_instructions = false
include_environment_context = false
include_collaboration_mode_instructions = false
web_search = "disabled"

[features]
goals = false
skill_search = false
plugins = false
apps = false
view_image = false
shell_tool = false
unified_exec = false

[agents]
enabled = false

[skills]
include_instructions = false
"""


@pytest.mark.slow
def test_codex_says_hello_on_the_default_model(tmp_path, default_model_dir):
    """Codex sends no max_output_tokens nor temperature: the answer may take what the context
    has left (the KV pool holds a whole context of 2048), and greedy server defaults make it
    the same each run."""
    instructions = tmp_path / "instructions.md"
    instructions.write_text("You are a helpful assistant. Answer in one short sentence.\n")
    extra = SMALL_PROMPT.format(instructions=instructions)
    engine = AsyncEngine(small_engine(default_model_dir, 2048),
                         sampling_defaults=SamplingDefaults(temperature=0.0))  # fmt: skip
    recorder = BodyRecorder(build_app(engine, "default"))
    with running_app(recorder) as url:
        result = run_codex(tmp_path, codex_config(url, "default", extra), "Say hello")
    assert result.returncode == 0, result.stderr[-3000:]
    # A 4xx/5xx shows only in Codex's log, in its own words: each request it made got a 200.
    assert recorder.statuses and set(recorder.statuses) == {200}, result.stderr[-3000:]
    assert "hello" in result.stdout.lower(), (result.stdout, result.stderr[-3000:])
