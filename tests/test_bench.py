"""`metal-serve bench`: metric math, SSE parsing, workloads, and one real run against our server."""

from __future__ import annotations

import ast
import asyncio
import base64
import io
import json
import random
import re
import struct

import pytest
from PIL import Image
from server_helpers import running_server, small_engine

from server.bench.client import CHAT, COMPLETIONS, Sampling, StreamResult, request_body
from server.bench.metrics import RequestRecord, compute_metrics, parse_slos
from server.bench.router import prefix_counts
from server.bench.runner import run_sessions, send_requests
from server.bench.serve_bench import ServeBenchConfig, build_workload
from server.bench.sse import SSEDecoder, parse_event
from server.bench.workloads import (
    CODE_EDIT_SYSTEM,
    RequestSpec,
    TokenText,
    agent_sessions,
    random_requests,
    shared_prefix_requests,
    vision_requests,
)
from server.cli import build_parser, main
from server.dashboard.screenshot import find_chromium

# ---- metrics -------------------------------------------------------------------------------


def record(chunk_times, latency, output_tokens, error=None) -> RequestRecord:
    return RequestRecord(
        start=0.0,
        latency=latency,
        chunk_times=tuple(chunk_times),
        input_tokens=10,
        output_tokens=output_tokens,
        error=error,
    )


RECORDS = [
    record([0.1, 0.2, 0.4], 0.5, 5),  # TTFT 100, TPOT (500-100)/4 = 100, ITL 100, 200
    record([0.3, 0.35], 0.4, 3),  # TTFT 300, TPOT (400-300)/2 = 50, ITL 50
    record([], 0.05, 0, error="HTTP 500 from /v1/chat/completions: boom"),
    record([0.2], 0.2, 1),  # TTFT 200, no TPOT, no ITL
]


def test_metrics_match_hand_computed_values():
    m = compute_metrics(RECORDS, duration_s=2.0)
    assert (m.completed, m.failed) == (3, 1)
    assert m.errors == ("HTTP 500 from /v1/chat/completions: boom",)
    assert (m.total_input_tokens, m.total_output_tokens) == (30, 9)
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(4.5)
    assert m.total_token_throughput == pytest.approx(19.5)
    # numpy's linear percentiles: TTFT sorted [100, 200, 300], p90 at rank 1.8 -> 280.
    ttft = m.ttft
    assert (ttft.mean, ttft.p50, ttft.p90, ttft.p99) == pytest.approx((200, 200, 280, 298))
    tpot = m.tpot
    assert (tpot.mean, tpot.p50, tpot.p90, tpot.p99) == pytest.approx((75, 75, 95, 99.5))
    itl = m.itl  # pooled gaps [100, 200, 50]
    assert (itl.mean, itl.p50, itl.p90, itl.p99) == pytest.approx((350 / 3, 100, 180, 198))
    assert m.e2el.mean == pytest.approx(1100 / 3) and m.e2el.p50 == pytest.approx(400)
    assert m.goodput is None


def test_goodput_counts_requests_meeting_every_slo():
    # TTFT <= 250 and TPOT <= 60: the first misses TPOT, the second TTFT; the single-token
    # answer has no TPOT to miss. One good request in 2 s.
    m = compute_metrics(RECORDS, 2.0, parse_slos(["ttft:250", "tpot:60"]))
    assert m.goodput == pytest.approx(0.5)
    assert compute_metrics(RECORDS, 2.0, {"e2el": 450}).goodput == pytest.approx(1.0)


def test_empty_distributions_and_bad_slos():
    m = compute_metrics([record([], 0.1, 0, error="x")], 1.0)
    assert m.completed == 0 and m.ttft.mean is None and m.itl.p99 is None
    with pytest.raises(ValueError, match="ttft, tpot, e2el"):
        parse_slos(["latency:5"])
    with pytest.raises(ValueError, match="ttft:500"):
        parse_slos(["ttft:fast"])


# ---- SSE -----------------------------------------------------------------------------------

CHAT_STREAM = (
    'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\r\n\r\n'
    ": ping\r\n\r\n"
    'data: {"choices":[{"index":0,"delta":{"content":"Hel"},"finish_reason":null}]}\r\n\r\n'
    'data: {"choices":[{"index":0,"delta":{"content":"lo"},"finish_reason":null}]}\r\n\r\n'
    'data: {"choices":[{"index":0,"delta":{},"finish_reason":"length"}]}\r\n\r\n'
    'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2,"total_tokens":7}}'
    "\r\n\r\n"
    "data: [DONE]\r\n\r\n"
)
COMPLETION_STREAM = (
    'data: {"choices":[{"index":0,"text":" Par","finish_reason":null}]}\n\n'
    'data: {"choices":[{"index":0,"text":"is","finish_reason":"stop"}]}\n\n'
    "data: [DONE]\n\n"
)


def decode_in_pieces(stream: str, size: int) -> list[str]:
    decoder = SSEDecoder()
    events = []
    for i in range(0, len(stream), size):
        events += decoder.feed(stream[i : i + size])
    return events + decoder.close()


@pytest.mark.parametrize("size", [1, 2, 7, 10_000])
def test_sse_chat_stream_in_any_pieces(size):
    deltas = [parse_event(e) for e in decode_in_pieces(CHAT_STREAM, size)]
    assert len(deltas) == 6  # the ping comment is not an event
    assert "".join(d.text for d in deltas) == "Hello"
    assert [d.completion_tokens for d in deltas if d.completion_tokens] == [2]
    assert [d.done for d in deltas] == [False] * 5 + [True]
    assert not any(d.error for d in deltas)


def test_sse_completion_stream_without_usage_or_final_blank_line():
    events = decode_in_pieces(COMPLETION_STREAM.removesuffix("\n\n"), 3)
    deltas = [parse_event(e) for e in events]
    assert [d.text for d in deltas] == [" Par", "is", ""]
    assert deltas[-1].done and all(d.completion_tokens is None for d in deltas)


def test_sse_errors_and_multiline_data():
    assert SSEDecoder().feed("event: x\ndata: a\ndata: b\n\n") == ["a\nb"]
    assert "overloaded" in parse_event('{"error": {"message": "overloaded"}}').error
    assert "not JSON" in parse_event("<html>").error


def test_request_body_per_endpoint():
    spec = RequestSpec(({"role": "system", "content": "S"}, {"role": "user", "content": "U"}), 8)
    sampling = Sampling(model="m", eos_token_ids=(2, 0))
    chat = request_body(CHAT, spec, sampling)
    assert chat["messages"] == [dict(m) for m in spec.messages] and "prompt" not in chat
    assert chat["max_tokens"] == 8 and chat["stream"] and chat["temperature"] == 0.0
    assert chat["ignore_eos"] and chat["logit_bias"] == {"2": -100, "0": -100}
    completion = request_body(COMPLETIONS, spec, Sampling(model=None, ignore_eos=False))
    assert completion["prompt"] == "S\n\nU" and "model" not in completion
    assert "ignore_eos" not in completion and "logit_bias" not in completion


def test_several_models_spread_the_requests_in_turn(default_tokenizer):
    """`--model base,a,b` (LoRA adapters beside their base): request i names name i mod 3."""
    config = ServeBenchConfig(base_url="http://x", num_prompts=7, input_len=8, output_len=4,
                              model="base", models=("base", "a", "b"))
    requests, _ = build_workload(config, default_tokenizer)
    sampling = Sampling(model="base")
    assert [request_body(CHAT, r, sampling)["model"] for r in requests] == [
        "base", "a", "b", "base", "a", "b", "base"]
    with pytest.raises(ValueError, match="agents session keeps one model"):
        ServeBenchConfig(base_url="http://x", workload="agents", models=("base", "a"))


# ---- workloads -----------------------------------------------------------------------------


@pytest.fixture
def token_text(default_tokenizer) -> TokenText:
    return TokenText(default_tokenizer, random.Random(0))


def test_random_lengths_stay_in_range(token_text):
    specs = random_requests(token_text, random.Random(1), 20, 40, 10, range_ratio=0.5)
    input_lens = [token_text.count(s.messages[0]["content"]) for s in specs]
    assert all(20 <= n <= 60 for n in input_lens) and len(set(input_lens)) > 1
    assert all(5 <= s.output_len <= 15 for s in specs)
    exact = random_requests(token_text, random.Random(2), 5, 33, 7)
    assert [token_text.count(s.messages[0]["content"]) for s in exact] == [33] * 5
    assert [s.output_len for s in exact] == [7] * 5


def test_shared_prefix_groups_share_prefix_tokens(token_text, default_tokenizer):
    specs = shared_prefix_requests(token_text, 3, 4, 50, 10, 8)
    assert [s.group for s in specs] == [0] * 4 + [1] * 4 + [2] * 4
    prefixes = {g: {s.messages[0]["content"] for s in specs if s.group == g} for g in range(3)}
    assert all(len(p) == 1 for p in prefixes.values()) and len(set.union(*prefixes.values())) == 3
    for group in range(3):
        members = [s for s in specs if s.group == group]
        prefix = default_tokenizer.encode(members[0].messages[0]["content"])
        assert len(prefix) == 50
        for spec in members:  # the completions prompt keeps the prefix tokens intact
            assert default_tokenizer.encode(spec.prompt())[:50] == prefix
        assert len({s.messages[1]["content"] for s in members}) == 4


def echo_sender(log: list[RequestSpec]):
    async def send(spec: RequestSpec) -> StreamResult:
        log.append(spec)
        await asyncio.sleep(0)
        return StreamResult((0.01,), 0.02, f"answer {len(spec.messages)}", None, None)

    return send


def test_agent_conversations_grow_turn_by_turn(token_text):
    sessions = agent_sessions(token_text, random.Random(3), 3, 4, 200, 16, 24, 8)
    assert len({s.system for s in sessions}) == 1 and "tool_0" in sessions[0].system
    assert token_text.count(sessions[0].system) >= 200
    sent = asyncio.run(run_sessions(sessions, echo_sender([])))
    assert len(sent) == 12
    for index, session in enumerate(sessions):
        turns = [s for s in sent if s.session == index]
        assert [s.turn for s in turns] == [0, 1, 2, 3]
        assert [m["role"] for m in turns[0].spec.messages] == ["system", "user"]
        for before, after in zip(turns, turns[1:], strict=False):
            grown = before.spec.messages + (
                {"role": "assistant", "content": before.result.text},
                {"role": "user", "content": session.tool_results[before.turn]},
            )
            assert after.spec.messages == grown


def test_a_failed_turn_ends_its_session(token_text):
    sessions = agent_sessions(token_text, random.Random(4), 2, 3, 20, 4, 4, 4)

    async def fail_second_turn(spec: RequestSpec) -> StreamResult:
        error = "boom" if len(spec.messages) > 2 else None
        return StreamResult((0.01,), 0.02, "ok", None, error)

    sent = asyncio.run(run_sessions(sessions, fail_second_turn))
    assert sorted((s.session, s.turn) for s in sent) == [(0, 0), (0, 1), (1, 0), (1, 1)]


def code_edit_specs(tokenizer, seed=0, input_len=512, num_prompts=6) -> list[RequestSpec]:
    config = ServeBenchConfig(
        "http://127.0.0.1:1", "code-edit", num_prompts=num_prompts, input_len=input_len,
        output_len=300, seed=seed,
    )  # fmt: skip
    requests, sessions = build_workload(config, tokenizer)
    assert sessions == []
    return requests


def test_code_edit_is_deterministic_for_a_seed(default_tokenizer):
    first = code_edit_specs(default_tokenizer, seed=5)
    assert code_edit_specs(default_tokenizer, seed=5) == first
    assert code_edit_specs(default_tokenizer, seed=6) != first
    assert len({s.messages[1]["content"] for s in first}) == len(first)


def test_code_edit_prompts_hold_a_file_and_an_instruction_on_it(default_tokenizer):
    kinds, node_types = set(), set()
    for spec in code_edit_specs(default_tokenizer, num_prompts=12):
        system, user = spec.messages
        assert system == {"role": "system", "content": CODE_EDIT_SYSTEM}
        assert user["role"] == "user" and spec.output_len == 300
        match = re.fullmatch(
            r"Here is (\w+)\.py:\n\n```python\n(.*)```\n\n(.+)", user["content"], re.S
        )
        assert match, user["content"][:200]
        module = ast.parse(match[2])  # real Python, not vocabulary soup
        defs = [n for n in module.body if isinstance(n, ast.FunctionDef | ast.ClassDef)]
        assert defs and all(ast.get_docstring(n) for n in defs)
        functions = {n.name for n in defs if isinstance(n, ast.FunctionDef)}
        node_types |= {type(n) for n in ast.walk(module)}
        instruction = match[3]
        target = re.search(r"`(\w+)`", instruction)[1]
        assert target in functions, instruction
        if instruction.startswith("Rename"):
            new_name = re.findall(r"`(\w+)`", instruction)[1]
            assert new_name not in functions and new_name != target
            kinds.add("rename")
        elif "comment" in instruction:
            old_comment = re.search(r"the comment `(# [^`]+)`", instruction)[1]
            assert old_comment in match[2]
            kinds.add("comment")
        else:
            assert instruction.startswith("Add a keyword parameter")
            kinds.add("parameter")
    assert kinds == {"rename", "comment", "parameter"}
    assert {ast.For, ast.While, ast.Try, ast.ClassDef} <= node_types


@pytest.mark.parametrize("input_len", [256, 1024, 4096])
def test_code_edit_user_message_is_near_the_input_length(default_tokenizer, input_len):
    for spec in code_edit_specs(default_tokenizer, input_len=input_len, num_prompts=4):
        ids = default_tokenizer.encode(spec.messages[1]["content"], add_special_tokens=False)
        assert abs(len(ids) - input_len) <= max(16, input_len // 20), len(ids)


def test_cli_accepts_the_code_edit_workload():
    argv = ["bench", "serve", "--base-url", "http://x", "--workload", "code-edit"]
    assert build_parser(argv).parse_args(argv).workload == "code-edit"
    with pytest.raises(SystemExit):
        build_parser(argv).parse_args([*argv[:-1], "code-golf"])


def test_vision_requests_hold_a_picture_of_the_size_each_its_own(default_tokenizer):
    def requests():
        rng = random.Random(3)
        return vision_requests(TokenText(default_tokenizer, rng), rng, 3, (40, 24), 8, 5)

    specs = requests()
    assert specs == requests()  # drawn from the seed
    token_text = TokenText(default_tokenizer, random.Random(0))
    urls = []
    for spec in specs:
        (message,) = spec.messages
        image, question = message["content"]
        url = image["image_url"]["url"]
        header, data = url.split(",")
        assert header == "data:image/png;base64"
        assert Image.open(io.BytesIO(base64.b64decode(data))).size == (40, 24)
        assert token_text.count(question["text"]) == 8 and spec.output_len == 5
        urls.append(url)
    assert len(set(urls)) == 3


def test_the_vision_workload_needs_chat_and_takes_an_image_size():
    argv = ["bench", "serve", "--base-url", "http://x", "--workload", "vision"]
    assert build_parser(argv).parse_args([*argv, "--image-size", "640x360"]).image_size == (
        640, 360)
    with pytest.raises(SystemExit):
        build_parser(argv).parse_args([*argv, "--image-size", "640"])
    with pytest.raises(ValueError, match="use --endpoint /v1/chat/completions"):
        ServeBenchConfig(base_url="http://x", workload="vision", endpoint=COMPLETIONS)


def test_send_requests_respects_max_concurrency():
    in_flight = peak = 0

    async def send(spec: RequestSpec) -> StreamResult:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.01)
        in_flight -= 1
        return StreamResult((), 0.01, "", None, None)

    specs = [RequestSpec(({"role": "user", "content": str(i)},), 1) for i in range(10)]
    sent = asyncio.run(send_requests(specs, send, max_concurrency=3))
    assert peak == 3 and [s.spec for s in sent] == specs


# ---- a real run against our server ----------------------------------------------------------


@pytest.fixture(scope="module")
def base_url(default_model_dir):
    with running_server(small_engine(default_model_dir, max_model_len=512)) as url:
        yield url


def bench(base_url, default_model_dir, tmp_path, options: str) -> dict:
    out = tmp_path / "result.json"
    fixed = f"--base-url {base_url} --tokenizer {default_model_dir} --output-len 4"
    argv = ["bench", "serve", *fixed.split(), "--result-json", str(out), *options.split()]
    assert main(argv) == 0
    return json.loads(out.read_text())


@pytest.mark.slow
def test_bench_serve_against_our_server(base_url, default_model_dir, tmp_path):
    options = "--num-prompts 4 --input-len 16 --max-concurrency 2 --goodput e2el:60000"
    result = bench(base_url, default_model_dir, tmp_path, options)
    (run,) = result["runs"]
    assert result["config"]["model"] == "default" and run["max_concurrency"] == 2
    metrics = run["metrics"]
    assert (metrics["completed"], metrics["failed"], metrics["errors"]) == (4, 0, [])
    assert metrics["total_output_tokens"] == 16 and metrics["goodput"] > 0
    for r in run["records"]:
        assert r["output_tokens"] == 4 and r["server_output_tokens"] == 4 and r["error"] is None
        assert r["ttft"] > 0 and len(r["itl"]) == len(r["chunk_times"]) - 1
        assert r["input_tokens"] > 16  # the chat template's tokens count too


@pytest.mark.slow
def test_bench_agents_against_our_server(base_url, default_model_dir, tmp_path):
    options = (
        "--workload agents --sessions 2 --turns 2 --prefix-len 64 --input-len 8 "
        "--tool-result-len 8 --num-warmups 0"
    )
    records = bench(base_url, default_model_dir, tmp_path, options)["runs"][0]["records"]
    assert sorted((r["session"], r["turn"]) for r in records) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    first = {r["session"]: r["input_tokens"] for r in records if r["turn"] == 0}
    second = {r["session"]: r["input_tokens"] for r in records if r["turn"] == 1}
    assert all(second[s] > first[s] + 8 for s in first)  # + the answer and the tool result


@pytest.mark.slow
@pytest.mark.skipif(find_chromium() is None, reason="no Chromium: apt-get install chromium")
def test_bench_agents_saves_a_dashboard_screenshot(base_url, default_model_dir, tmp_path, capsys):
    png = tmp_path / "dashboard.png"
    # Answers long enough that requests still run once Chromium has the page open: with
    # drafting on by default, 48-token turns could all end before it.
    options = (
        "--workload agents --sessions 3 --turns 2 --prefix-len 64 --input-len 8 "
        "--tool-result-len 8 --output-len 128 --num-warmups 0 --dashboard-screenshot-delay 0 "
        f"--dashboard-screenshot {png}"
    )
    bench(base_url, default_model_dir, tmp_path, options)
    assert f"dashboard screenshot: {png}" in capsys.readouterr().out
    header = png.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", header[16:24])  # the PNG's IHDR
    assert width == 1280 and height >= 900


@pytest.mark.slow
def test_bench_shared_prefix_completions_against_our_server(base_url, default_model_dir, tmp_path):
    options = (
        "--workload shared-prefix --endpoint /v1/completions --num-groups 2 "
        "--prompts-per-group 2 --prefix-len 32 --input-len 8 --num-warmups 0"
    )
    (run,) = bench(base_url, default_model_dir, tmp_path, options)["runs"]
    assert run["metrics"]["completed"] == 4
    # Re-tokenizing can merge what the model produced as separate tokens ("\n" "\n" -> "\n\n").
    assert all(r["server_output_tokens"] == 4 for r in run["records"])
    assert all(2 <= r["output_tokens"] <= 4 for r in run["records"])


@pytest.mark.slow
def test_bench_code_edit_against_our_server(base_url, default_model_dir, tmp_path):
    options = "--workload code-edit --num-prompts 2 --input-len 200 --num-warmups 0"
    (run,) = bench(base_url, default_model_dir, tmp_path, options)["runs"]
    assert (run["metrics"]["completed"], run["metrics"]["failed"]) == (2, 0)
    assert all(r["input_tokens"] > 200 and r["server_output_tokens"] == 4 for r in run["records"])


@pytest.mark.slow
def test_bench_serve_reports_each_replicas_prefix_hits(
    base_url, default_model_dir, tmp_path, capsys
):
    before = prefix_counts(base_url)
    options = ("--workload agents --sessions 2 --turns 2 --prefix-len 32 --input-len 16 "
               f"--tool-result-len 8 --num-warmups 0 --replica-url {base_url}")  # fmt: skip
    bench(base_url, default_model_dir, tmp_path, options)
    counts = prefix_counts(base_url) - before
    assert 0 < counts.hits < counts.queried  # a session's second turn reuses its first
    lines = capsys.readouterr().out.splitlines()
    row = next(line for line in lines if line.startswith(base_url))
    assert row.split()[1:] == [f"{counts.queried:.0f}", f"{counts.hits:.0f}", f"{counts.rate:.1%}"]


def test_bench_models_runs_its_three_phases_on_a_server_of_tiny_models(tmp_path, capsys):
    from tiny_models import build_tiny_model
    from tiny_server import CHAT_TEMPLATE

    build_tiny_model("llama", tmp_path / "tiny")
    (tmp_path / "tiny" / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": CHAT_TEMPLATE}))
    out, log = tmp_path / "gaps.json", tmp_path / "server.log"
    assert main(["bench", "models", str(tmp_path / "tiny"), "--busy-streams", "2",
                 "--tokens", "8", "--kv-cache-memory", "4MiB", "--max-model-len", "128",
                 "--log", str(log), "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert list(results) == ["alone", "busy model saturated", "third model loading"]
    for gaps in results.values():
        assert gaps["tokens"] >= 2 and 0 <= gaps["p50_ms"] <= gaps["p99_ms"] <= gaps["max_ms"]
    assert "third model loading" in capsys.readouterr().out
    server_log = log.read_text()
    assert "model 'third' loaded" in server_log and "unloading model 'third' as asked" in server_log
