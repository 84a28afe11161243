"""Subcommands whose modules load only when chosen, so `metal-serve --help` stays quick."""

from __future__ import annotations

import argparse
import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    """A subcommand: `module.add_arguments(parser)` builds its parser, `module.run(args)` runs it.

    A command with subcommands of its own (`nested`) gets `add_arguments(parser, argv)` with the
    arguments after its name, to pick which of its own to load.
    """

    help: str
    module: str
    add_arguments: str
    run: str
    nested: bool = False


def add_commands(
    parser: argparse.ArgumentParser, commands: dict[str, Command], argv: list[str], dest: str
) -> None:
    """One subparser per command; only the one named by `argv[0]` imports its module."""
    sub = parser.add_subparsers(dest=dest, required=True, metavar=dest.upper())
    chosen = argv[0] if argv else None
    for name, command in commands.items():
        sub_parser = sub.add_parser(name, help=command.help, description=command.help)
        if name != chosen:
            continue
        add = getattr(importlib.import_module(command.module), command.add_arguments)
        if command.nested:
            add(sub_parser, argv[1:])
        else:
            add(sub_parser)


def run_command(command: Command, args: argparse.Namespace) -> int:
    return getattr(importlib.import_module(command.module), command.run)(args)
