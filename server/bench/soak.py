"""`metal-serve bench soak`: a long run of agent sessions, some abandoned mid-answer, against a
metal-serve it starts itself, checking that nothing wears down.

Each of `sessions` workers runs agent sessions of `turns` turns back to back (a shared
system prompt, a task, tool results; every turn sends the whole conversation so far,
streamed). With probability
`abort_fraction` a turn's client hangs up after a random number of chunks, ending its session.
The run passes when no request failed, no KV block is still held once the server is idle,
and the server's resident memory grew less than `max_rss_growth` after warm-up (median of
the samples in the run's last tenth over the median of those right after warm-up).
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from server.bench.client import CHAT, Sampling, request_body
from server.bench.peers import OUR_CLI
from server.bench.server_process import free_port, running_server
from server.bench.sse import SSEDecoder, parse_event
from server.bench.workloads import RequestSpec, TokenText, agent_system_prompt, tool_result

_IDLE_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class SoakConfig:
    duration_s: float = 1800.0
    sessions: int = 24
    abort_fraction: float = 0.2
    turns: int = 4
    system_len: int = 512
    task_len: int = 64
    tool_result_len: int = 128
    output_len: int = 32
    warmup_fraction: float = 0.1
    sample_every_s: float = 10.0
    max_rss_growth: float = 0.05
    seed: int = 0
    serve_args: tuple[str, ...] = ()  # extra `metal-serve serve` arguments, e.g. a model

    def __post_init__(self) -> None:
        if not 0 <= self.abort_fraction <= 1:
            raise ValueError(f"--abort-fraction must be in [0, 1], got {self.abort_fraction}")
        if self.duration_s <= 0 or self.sessions < 1 or self.turns < 1:
            raise ValueError("--duration, --sessions and --turns must be positive")


@dataclass
class SoakReport:
    requests: int = 0
    completed: int = 0
    aborted: int = 0  # by the client, on purpose
    errors: list[str] = field(default_factory=list)
    rss_samples: list[tuple[float, int]] = field(default_factory=list)  # (seconds, bytes)
    kv_usage_when_idle: float | None = None
    rss_growth: float | None = None

    def verdicts(self, config: SoakConfig) -> dict[str, bool]:
        return {
            "no errors": not self.errors,
            "no KV blocks held once idle": self.kv_usage_when_idle == 0.0,
            f"RSS growth under {config.max_rss_growth:.0%}": self.rss_growth is not None
            and self.rss_growth < config.max_rss_growth,
        }


def rss_bytes(pid: int) -> int:
    """Resident memory of process `pid`: /proc on Linux, `ps` elsewhere (macOS)."""
    status = Path(f"/proc/{pid}/status")
    if status.exists():
        match = re.search(r"^VmRSS:\s+(\d+) kB", status.read_text(), re.MULTILINE)
        return int(match.group(1)) * 1024 if match else 0
    out = subprocess.run(["ps", "-o", "rss=", "-p", str(pid)], capture_output=True, text=True)
    return int(out.stdout.strip() or 0) * 1024


def rss_growth(samples: list[tuple[float, int]], duration_s: float, warmup_s: float) -> float:
    """Median RSS of the run's last tenth over the median of the tenth after warm-up, - 1."""
    window = duration_s / 10
    early = [rss for t, rss in samples if warmup_s <= t < warmup_s + window]
    late = [rss for t, rss in samples if t >= duration_s - window]
    if not early or not late:
        raise ValueError("too few memory samples: lengthen --duration or sample more often")
    return statistics.median(late) / statistics.median(early) - 1


def scrape(text: str, name: str) -> float | None:
    """The first sample of metric `name` in Prometheus text."""
    match = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else None


class _Soak:
    def __init__(self, config: SoakConfig, client: httpx.AsyncClient, text: TokenText) -> None:
        self.config = config
        self.client = client
        self.text = text
        self.report = SoakReport()
        self.rng = random.Random(config.seed)
        # One system prompt for every session, as one agent's sessions share theirs.
        self.system = agent_system_prompt(text, self.rng, config.system_len)

    async def run_worker(self, stop_at: float) -> None:
        config = self.config
        while time.monotonic() < stop_at:
            messages = [
                {"role": "system", "content": self.system},
                {"role": "user", "content": self.text.random(config.task_len)},
            ]
            for _ in range(config.turns):
                spec = RequestSpec(tuple(messages), config.output_len)
                abort = self.rng.random() < config.abort_fraction
                abort_after = self.rng.randint(0, config.output_len // 2) if abort else None
                answer = await self.one_turn(spec, abort_after)
                if answer is None:
                    break
                messages.append({"role": "assistant", "content": answer})
                result = tool_result(self.text, self.rng, config.tool_result_len)
                messages.append({"role": "user", "content": result})

    async def one_turn(self, spec: RequestSpec, abort_after: int | None) -> str | None:
        """The answer's text; None if the turn was abandoned or failed."""
        self.report.requests += 1
        body = request_body(CHAT, spec, Sampling(model=None, ignore_eos=True))
        chunks: list[str] = []
        try:
            async with self.client.stream("POST", CHAT, json=body) as response:
                if response.status_code != 200:
                    detail = (await response.aread()).decode(errors="replace")[:200]
                    self.report.errors.append(f"HTTP {response.status_code}: {detail}")
                    return None
                decoder = SSEDecoder()
                async for piece in response.aiter_text():
                    for data in decoder.feed(piece):
                        delta = parse_event(data)
                        if delta.error:
                            self.report.errors.append(f"error event: {delta.error}"[:300])
                            return None
                        chunks.append(delta.text or "")
                    if abort_after is not None and len(chunks) > abort_after:
                        self.report.aborted += 1
                        return None  # leaving the block closes the connection
        except httpx.HTTPError as exc:
            self.report.errors.append(f"{type(exc).__name__}: {exc}"[:300])
            return None
        self.report.completed += 1
        return "".join(chunks)

    async def sample_memory(self, pid: int, start: float, stop_at: float) -> None:
        while time.monotonic() < stop_at:
            self.report.rss_samples.append((time.monotonic() - start, rss_bytes(pid)))
            await asyncio.sleep(self.config.sample_every_s)

    async def wait_idle(self) -> float | None:
        """kv_cache_usage_perc once nothing runs or waits (None if it never got idle)."""
        deadline = time.monotonic() + _IDLE_TIMEOUT_S
        while time.monotonic() < deadline:
            metrics = (await self.client.get("/metrics")).text
            busy = (scrape(metrics, "vllm:num_requests_running") or 0) + (
                scrape(metrics, "vllm:num_requests_waiting") or 0
            )
            if busy == 0:
                return scrape(metrics, "vllm:kv_cache_usage_perc")
            await asyncio.sleep(0.5)
        return None


async def _soak(config: SoakConfig, base_url: str, pid: int, text: TokenText) -> SoakReport:
    timeout = httpx.Timeout(600.0, connect=30.0)
    limits = httpx.Limits(max_connections=config.sessions + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=limits) as client:
        soak = _Soak(config, client, text)
        start = time.monotonic()
        stop_at = start + config.duration_s
        sampler = asyncio.create_task(soak.sample_memory(pid, start, stop_at))
        await asyncio.gather(*(soak.run_worker(stop_at) for _ in range(config.sessions)))
        await sampler
        soak.report.kv_usage_when_idle = await soak.wait_idle()
        soak.report.rss_samples.append((time.monotonic() - start, rss_bytes(pid)))
    warmup_s = config.duration_s * config.warmup_fraction
    soak.report.rss_growth = rss_growth(soak.report.rss_samples, config.duration_s, warmup_s)
    return soak.report


def run_soak(config: SoakConfig, work_dir: Path, tokenizer: Any) -> SoakReport:
    """Start `metal-serve serve` on a free port, soak it, stop it."""
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-c", OUR_CLI, "serve", *config.serve_args, "--port", str(port)]
    text = TokenText(tokenizer, random.Random(config.seed))
    with running_server(command, base_url, work_dir / "soak-server.log") as process:
        return asyncio.run(_soak(config, base_url, process.pid, text))


def format_report(config: SoakConfig, report: SoakReport) -> str:
    rss = [r for _, r in report.rss_samples]
    growth = "n/a" if report.rss_growth is None else f"{report.rss_growth:+.2%}"
    lines = [
        f"soak: {config.duration_s:.0f} s, {config.sessions} sessions, "
        f"{config.abort_fraction:.0%} of turns abandoned",
        f"requests {report.requests}: {report.completed} completed, {report.aborted} aborted "
        f"by the client, {len(report.errors)} errors",
        f"KV cache usage once idle: {report.kv_usage_when_idle}",
        f"server RSS: {rss[0] / 2**20:.0f} MiB at start, max {max(rss) / 2**20:.0f} MiB, "
        f"{rss[-1] / 2**20:.0f} MiB at the end; growth after warm-up {growth}",
    ]
    lines += [f"  error: {error}" for error in report.errors[:10]]
    lines += [f"{'PASS' if ok else 'FAIL'}  {name}" for name, ok in report.verdicts(config).items()]
    return "\n".join(lines)


def add_soak_arguments(parser: Any) -> None:
    defaults = SoakConfig()
    parser.add_argument("--duration", type=float, default=defaults.duration_s, help="seconds")
    parser.add_argument("--sessions", type=int, default=defaults.sessions)
    parser.add_argument("--abort-fraction", type=float, default=defaults.abort_fraction,
                        help="share of turns whose client hangs up mid-answer")  # fmt: skip
    parser.add_argument("--turns", type=int, default=defaults.turns, help="per session")
    parser.add_argument("--output-len", type=int, default=defaults.output_len)
    parser.add_argument("--system-len", type=int, default=defaults.system_len)
    parser.add_argument("--sample-every", type=float, default=defaults.sample_every_s,
                        help="seconds between memory samples")  # fmt: skip
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--serve-args", default="",
                        help='extra `metal-serve serve` arguments, e.g. "MODEL_DIR"')  # fmt: skip
    parser.add_argument("--tokenizer", type=Path,
                        help="model dir whose tokenizer builds prompts (default: the default "
                        "model's)")  # fmt: skip
    parser.add_argument("--work-dir", type=Path, default=Path("bench-results"),
                        help="where the server log goes")  # fmt: skip
    parser.add_argument("--result-json", type=Path, help="write the config and the report")


def run_soak_command(args: Any) -> int:
    """0 when every check passed, 1 when one failed, 2 for bad arguments."""
    from server.bench.serve_bench import load_tokenizer

    try:
        config = SoakConfig(
            duration_s=args.duration, sessions=args.sessions, abort_fraction=args.abort_fraction,
            turns=args.turns, output_len=args.output_len, system_len=args.system_len,
            sample_every_s=args.sample_every, seed=args.seed,
            serve_args=tuple(shlex.split(args.serve_args)),
        )  # fmt: skip
        tokenizer = load_tokenizer(args.tokenizer)
        report = run_soak(config, args.work_dir, tokenizer)
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"metal-serve bench soak: error: {exc}", file=sys.stderr)
        return 2
    print(format_report(config, report))
    if args.result_json is not None:
        args.result_json.parent.mkdir(parents=True, exist_ok=True)
        payload = {"config": asdict(config), "report": asdict(report)}
        args.result_json.write_text(json.dumps(payload, indent=2))
    return 0 if all(report.verdicts(config).values()) else 1
