"""The `metal-serve bench` subcommands; each one's module loads only when it is chosen."""

from __future__ import annotations

import argparse

from server.commands import Command, add_commands, run_command

BENCHMARKS = {
    "serve": Command(
        "load-test any OpenAI-compatible server (TTFT, TPOT, ITL, throughput)",
        "server.bench.serve_cli", "add_serve_arguments", "run_serve",
    ),
    "compare": Command(
        "install peer servers, run the same workloads on each, write docs/benchmarks.md",
        "server.bench.compare", "add_compare_arguments", "run_compare",
    ),
    "soak": Command(
        "a long run of agent sessions with client aborts: errors, leaked KV blocks, memory",
        "server.bench.soak", "add_soak_arguments", "run_soak_command",
    ),
    "throughput": Command(
        "offline throughput of the engine, no HTTP",
        "server.bench.engine_bench", "add_throughput_arguments", "run_throughput",
    ),
    "step": Command(
        "host overhead per engine step, with the model stubbed out",
        "server.bench.engine_bench", "add_step_arguments", "run_step",
    ),
    "models": Command(
        "one model's inter-token gaps on a server of several: alone, beside a saturated "
        "model, while another loads",
        "server.bench.models", "add_models_arguments", "run_models",
    ),
    "graph": Command(
        "kernels, host build time and syncs of a Metal step beside mlx-lm's, traced (no GPU)",
        "server.bench.graph", "add_graph_arguments", "run_graph",
    ),
}


def add_bench_arguments(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    add_commands(parser, BENCHMARKS, argv, dest="benchmark")


def run_bench(args: argparse.Namespace) -> int:
    return run_command(BENCHMARKS[args.benchmark], args)
