"""The `metal-serve` command: `serve`, `status`, `convert`, `bench` and `doctor`."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from server.arg_types import parse_size
from server.commands import Command, add_commands, run_command

__all__ = ["COMMANDS", "build_parser", "main", "parse_size", "run"]

COMMANDS = {
    "serve": Command(
        "serve a model over HTTP", "server.launch", "add_arguments", "serve"
    ),
    "status": Command(
        "show what a running server is doing: requests, KV pool, cache hits, speed",
        "server.dashboard.status_cli", "add_status_arguments", "run_status",
    ),
    "convert": Command(
        "convert a checkpoint into a model directory",
        "convert.cli", "add_convert_arguments", "run_convert",
    ),
    "bench": Command(
        "benchmark a server, peer servers, or the engine",
        "server.bench.commands", "add_bench_arguments", "run_bench", nested=True,
    ),
    "doctor": Command(
        "check the Metal attention kernels against the reference on this machine",
        "kernels_metal.doctor", "add_doctor_arguments", "run_doctor",
    ),
}


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The CLI; only the subcommand named in `argv` loads its module for its arguments."""
    parser = argparse.ArgumentParser(
        prog="metal-serve", description="LLM serving on MLX with an OpenAI-compatible API."
    )
    add_commands(parser, COMMANDS, argv or [], dest="command")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    return run_command(COMMANDS[args.command], args)


def run() -> None:
    """The console script: `main`, then leave without running native libraries' exit hooks.

    Everything the command owns is closed by the time `main` returns (the server drained and
    spilled its KV cache, files are written). What is left are the static destructors of the
    native libraries loaded (MLX, OpenBLAS, tokenizers, PyTorch when transformers pulls it
    in), one of which now and then aborts the process ("terminate called without an active
    exception") while tearing down its worker threads, turning a clean exit into SIGABRT.
    """
    try:
        code = main()
    except SystemExit as exit_:  # argparse errors and --help
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 2)
        if isinstance(exit_.code, str):
            print(exit_.code, file=sys.stderr)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
