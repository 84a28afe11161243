"""`metal-serve bench compare`: the same workloads against each peer server.

Every peer's server is up for the whole comparison and the peers take turns at each workload,
`--rounds` times, in reversed order every other round: a shared machine's speed drifts by tens
of percent over minutes, and runs far apart in time would measure the drift.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from server.bench.compare_doc import PeerResult, write_doc

if TYPE_CHECKING:
    from server.bench.peers import Peer
    from server.bench.runner import RunResult

DEFAULT_WORK_DIR = Path.home() / ".cache" / "metal-serve" / "peers"
DEFAULT_DOCS_DIR = Path(__file__).resolve().parents[2] / "docs"
PEER_NAMES = ("metal-serve", "mlx-lm", "llama-cpp-python", "llama-server")
WORKLOAD_KINDS = ("single", "concurrent", "long", "agents")
_WORKLOAD_OPTIONS = (
    ("--output-len", 64, "tokens per answer, in every workload"),
    ("--single-requests", 4, "`single`: requests sent one at a time"),
    ("--concurrency", 16, "`concurrent-N`: requests sent at once"),
    ("--input-len", 128, "`concurrent-N`: prompt tokens"),
    ("--long-input-len", 8064, "`long-N`: prompt tokens of its requests, sent one at a time"),
    ("--sessions", 4, "`agents`: sessions"),
    ("--turns", 3, "`agents`: requests per session"),
    ("--prefix-len", 1024, "`agents`: tokens of the shared system prompt"),
    ("--tool-result-len", 128, "`agents`: tokens per tool result"),
)


def add_compare_arguments(parser: argparse.ArgumentParser) -> None:
    peers = parser.add_argument_group("peers")
    peers.add_argument(
        "--peers",
        default=",".join(PEER_NAMES),
        help=f"comma-separated, from: {', '.join(PEER_NAMES)}",
    )
    peers.add_argument(
        "--work-dir",
        type=Path,
        default=DEFAULT_WORK_DIR,
        help="peer venvs, server logs and raw results",
    )
    peers.add_argument(
        "--docs-dir",
        type=Path,
        default=DEFAULT_DOCS_DIR,
        help="where benchmarks.md and its plots go",
    )
    peers.add_argument(
        "--doc",
        default="benchmarks.md",
        help="page in --docs-dir whose results section is rewritten (plots named after it)",
    )
    peers.add_argument(
        "--build-timeout",
        type=float,
        default=25 * 60,
        help="seconds one peer's pip install (or llama-server's build) may take",
    )
    peers.add_argument(
        "--server-timeout", type=float, default=600, help="seconds a server may take to start"
    )
    peers.add_argument(
        "--no-install",
        dest="install",
        action="store_false",
        help="use only peers already installed in --work-dir",
    )
    peers.add_argument(
        "--no-engine-bench",
        dest="engine_bench",
        action="store_false",
        help="skip `bench throughput` and `bench step` for metal-serve",
    )
    peers.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="runs of each workload per peer, the peers taking turns; the median one is "
        "reported",
    )
    loads = parser.add_argument_group("workloads")
    loads.add_argument(
        "--workloads",
        default=",".join(WORKLOAD_KINDS),
        help=f"comma-separated, from: {', '.join(WORKLOAD_KINDS)}",
    )
    for flag, default, help_text in _WORKLOAD_OPTIONS:
        loads.add_argument(flag, type=int, default=default, help=help_text)


def workloads(args: argparse.Namespace) -> dict[str, dict]:
    """Workload name -> ServeBenchConfig fields of the `--workloads` asked for; every one
    generates `--output-len` tokens."""
    chosen = {k.strip() for k in args.workloads.split(",")}
    every = {
        "single": dict(
            workload="random", num_prompts=args.single_requests, input_len=32, max_concurrency=(1,)
        ),
        f"concurrent-{args.concurrency}": dict(
            workload="random",
            num_prompts=args.concurrency,
            input_len=args.input_len,
            max_concurrency=(args.concurrency,),
        ),
        f"long-{args.long_input_len}": dict(
            workload="random",
            num_prompts=2,
            input_len=args.long_input_len,
            max_concurrency=(1,),
        ),
        "agents": dict(
            workload="agents",
            sessions=args.sessions,
            turns=args.turns,
            prefix_len=args.prefix_len,
            input_len=64,
            tool_result_len=args.tool_result_len,
        ),
    }
    return {name: fields for name, fields in every.items() if name.split("-")[0] in chosen}


def run_compare(args: argparse.Namespace) -> int:
    from convert import ensure_default_model
    from convert.default_model import default_gguf_path
    from server.bench.peers import peers

    names = [n.strip() for n in args.peers.split(",") if n.strip()]
    unknown = sorted(set(names) - set(PEER_NAMES))
    if unknown:
        print(
            f"metal-serve bench compare: error: unknown peers {unknown}; "
            f"use {', '.join(PEER_NAMES)}",
            file=sys.stderr,
        )
        return 2
    unknown = sorted({k.strip() for k in args.workloads.split(",")} - set(WORKLOAD_KINDS))
    if unknown:
        print(
            f"metal-serve bench compare: error: unknown workloads {unknown}; "
            f"use {', '.join(WORKLOAD_KINDS)}",
            file=sys.stderr,
        )
        return 2
    try:
        model_dir, gguf = ensure_default_model(), default_gguf_path()
    except RuntimeError as exc:
        print(f"metal-serve bench compare: error: {exc}", file=sys.stderr)
        return 2
    if args.rounds < 1:
        print("metal-serve bench compare: error: --rounds must be at least 1", file=sys.stderr)
        return 2
    available = peers()
    results = _bench_peers([available[name] for name in names], model_dir, gguf, args)
    engine = _engine_benches(args) if args.engine_bench and "metal-serve" in names else {}
    path = write_doc(args.docs_dir, results, engine, workloads(args), args.output_len, args.doc)
    print(f"wrote {path}")
    return 0 if all(r.error is None for r in results) else 1


@dataclass
class _Server:
    """A peer whose server is up, and what its rounds gave so far."""

    peer: Peer
    base_url: str
    version: str | None
    install_s: float | None
    startup_s: float
    runs: dict[str, list[RunResult]] = field(default_factory=dict)
    error: str | None = None


def _bench_peers(chosen: list[Peer], model_dir: Path, gguf: Path,
                 args: argparse.Namespace) -> list[PeerResult]:
    from server.bench.serve_bench import ServeBenchConfig, load_tokenizer, run_serve_bench

    tokenizer = load_tokenizer(model_dir)
    with ExitStack() as stack:
        started = [_start(peer, model_dir, gguf, args, stack) for peer in chosen]
        servers = [s for s in started if isinstance(s, _Server)]
        for name, fields in workloads(args).items():
            for round_ in range(args.rounds):
                for server in servers if round_ % 2 == 0 else servers[::-1]:
                    if server.error is not None:
                        continue
                    # Prompts of its own each round: a repeated one would hit the caches.
                    config = ServeBenchConfig(base_url=server.base_url,
                                              model=server.peer.model_name,
                                              output_len=args.output_len, seed=round_,
                                              **fields)
                    try:
                        run = asyncio.run(run_serve_bench(config, tokenizer))[0]
                    except (RuntimeError, OSError) as exc:
                        print(f"[{server.peer.name}] failed: {exc}", flush=True)
                        server.error = str(exc).splitlines()[0]
                        continue
                    server.runs.setdefault(name, []).append(run)
                    _print_run(server.peer.name, name, run)
    return [_result(s, args.work_dir) if isinstance(s, _Server) else s for s in started]


def _start(peer: Peer, model_dir: Path, gguf: Path, args: argparse.Namespace,
           stack: ExitStack) -> _Server | PeerResult:
    """Install `peer` and start its server for the rest of `stack`'s block."""
    from server.bench.peers import install, server_command
    from server.bench.server_process import free_port, running_server

    installed = install(peer, args.work_dir, args.build_timeout, args.install)
    if installed.executable is None:
        print(f"[{peer.name}] skipped: {installed.error}", flush=True)
        return PeerResult(peer.name, None, installed.install_s, error=installed.error)
    _warn_if_busy(peer.name)
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    command = server_command(peer, installed.executable, model_dir, gguf, port, _blas_path())
    start = time.monotonic()
    try:
        stack.enter_context(running_server(
            command, base_url, args.work_dir / "logs" / f"{peer.name}.log", args.server_timeout
        ))
    except RuntimeError as exc:
        print(f"[{peer.name}] failed: {exc}", flush=True)
        return PeerResult(peer.name, installed.version, installed.install_s,
                          error=str(exc).splitlines()[0])
    startup_s = time.monotonic() - start
    print(f"[{peer.name}] up at {base_url} after {startup_s:.1f} s", flush=True)
    return _Server(peer, base_url, installed.version, installed.install_s, startup_s)


def _result(server: _Server, work_dir: Path) -> PeerResult:
    """Each workload's median round (by output tokens/s) and every round's rate."""
    median = {}
    for name, runs in server.runs.items():
        ranked = sorted(runs, key=lambda run: run.metrics.output_throughput)
        median[name] = ranked[(len(ranked) - 1) // 2]
    rates = {name: [run.metrics.output_throughput for run in runs]
             for name, runs in server.runs.items()}
    _save_raw(work_dir, server.peer.name, median)
    return PeerResult(server.peer.name, server.version, server.install_s, server.startup_s,
                      median, server.error, rates)


def _engine_benches(args: argparse.Namespace) -> dict[str, dict | str]:
    """`bench throughput` and `bench step` of metal-serve, each in a fresh process."""
    from server.bench.peers import OUR_CLI

    commands = {
        "throughput": [
            "throughput",
            "--num-prompts",
            str(args.concurrency),
            "--output-len",
            str(args.output_len),
        ],
        "step": ["step", "--batch-sizes", "1,16,64"],
    }
    results: dict[str, dict | str] = {}
    for name, extra in commands.items():
        out = args.work_dir / "results" / f"engine-{name}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-c", OUR_CLI, "bench", *extra, "--result-json", str(out)]
        print(f"[metal-serve] bench {name}", flush=True)
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode == 0 and out.is_file():
            results[name] = json.loads(out.read_text())
        else:
            results[name] = f"failed (exit {done.returncode}): {done.stderr.strip()[-300:]}"
    return results


def _warn_if_busy(name: str) -> None:
    busy = _cpu_busy()
    if busy is not None and busy > 0.25:
        print(
            f"[{name}] warning: the CPUs are {busy:.0%} busy before the run; "
            "stop other work for clean numbers",
            flush=True,
        )


def _cpu_busy(interval_s: float = 2.0) -> float | None:
    """Fraction of CPU time not idle over the next `interval_s` (Linux), else None."""
    # The load average trails by a minute: it would still show the previous peer's run.

    def sample() -> tuple[int, int]:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
        return sum(fields), fields[3] + fields[4]  # total, idle + iowait

    try:
        total0, idle0 = sample()
        time.sleep(interval_s)
        total1, idle1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    return 1.0 - (idle1 - idle0) / max(total1 - total0, 1)


def _blas_path() -> str | None:
    from metal_engine.blas import CANDIDATES

    override = os.environ.get("METAL_SERVE_BLAS")
    return next(
        (p for p in ((override,) if override else ()) + CANDIDATES if os.path.exists(p)), None
    )


def _print_run(peer: str, workload: str, run: RunResult) -> None:
    m = run.metrics
    print(
        f"[{peer}] {workload}: {m.completed} ok, {m.failed} failed, "
        f"{m.output_throughput:.1f} out tok/s, TTFT p50 {m.ttft.p50 or 0:.0f} ms, "
        f"TPOT p50 {m.tpot.p50 or 0:.1f} ms"
        + (f"; first failure: {m.errors[0]}" if m.errors else ""),
        flush=True,
    )


def _save_raw(work_dir: Path, peer: str, runs: dict[str, RunResult]) -> None:
    path = work_dir / "results" / f"{peer}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({name: run.to_json() for name, run in runs.items()}, indent=2))
