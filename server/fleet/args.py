"""`serve`'s options for several models, and the catalog they describe.

Models come from `--model NAME=REF` (repeated), `--models-dir DIR` (each model dir or .gguf
file in it, named by its file name) and `--models-config FILE` (TOML, docs/several-models.md); the
positional model joins them, under `--served-model-name` if one is given, else its own
name. Without any of the three the server serves one model, as it always has.
"""

from __future__ import annotations

import argparse
import copy
from dataclasses import replace
from pathlib import Path

import tomllib

from metal_engine.config import Task
from server.arg_types import parse_size, positive_int, positive_seconds
from server.fleet.catalog import ModelCatalog, ModelEntry
from server.model_loading import ENGINE_OPTIONS
from server.serve_args import add_serve_arguments

# What a model's own `options` may set: its engine and its requests' defaults. The rest
# (host, keys, limits) is the server's.
PER_MODEL_OPTIONS = frozenset((
    *ENGINE_OPTIONS, "revision", "generation_config", "override_generation_config",
    "default_max_tokens", "max_tokens_limit", "tool_call_parser", "max_queued_requests",
))  # fmt: skip
_CONFIG_KEYS = frozenset(("default_model", "max_loaded_models", "models_memory", "idle_ttl",
                          "models"))
_MODEL_KEYS = frozenset(("path", "aliases", "pin", "idle_ttl", "options"))


def add_fleet_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--model", dest="models", action="append", type=_named, metavar="NAME=MODEL",
        help="serve MODEL (a model dir, .gguf file or hub repo id) as NAME, besides the "
        "others; repeat for more",
    )
    group.add_argument(
        "--models-dir", type=Path, metavar="DIR",
        help="serve each model dir and .gguf file in DIR, named by its file name",
    )
    group.add_argument(
        "--models-config", type=Path, metavar="FILE",
        help="a TOML file of models with their aliases, pins and options "
        "(docs/several-models.md)",
    )
    group.add_argument(
        "--alias", dest="model_aliases", action="append", type=_alias,
        metavar="PATTERN=NAME",
        help="requests naming PATTERN (a name or a glob such as 'claude-*-haiku-*') go to "
        "model NAME; repeat for more",
    )
    group.add_argument(
        "--default-model", metavar="NAME",
        help="the model for names no model or alias matches (default: none, such a request "
        "is a 404)",
    )
    group.add_argument(
        "--max-loaded-models", type=positive_int, metavar="N",
        help="most models loaded at once; loading one more unloads the least recently used "
        "idle one (default: as many as memory holds)",
    )
    group.add_argument(
        "--models-memory", type=parse_size, metavar="SIZE",
        help="what the loaded models' weights and KV caches may take together, e.g. '24GiB' "
        "(default: the machine's usable memory less a headroom)",
    )
    group.add_argument(
        "--idle-ttl", type=positive_seconds, metavar="SECONDS",
        help="unload a model after this long without requests (default: keep it until its "
        "memory is needed)",
    )
    group.add_argument(
        "--pin", dest="pinned_models", action="append", metavar="NAME",
        help="load model NAME at start and never unload it; repeat for more",
    )


def model_catalog(args: argparse.Namespace) -> ModelCatalog | None:
    """The models `args` name, or None for a one-model server. ValueError or OSError naming
    the bad option or file."""
    if not (args.models or args.models_dir or args.models_config):
        return None
    config = _read_config(args.models_config) if args.models_config else {}
    entries: list[ModelEntry] = []
    if args.model_dir is not None:
        name = args.served_model_name
        if name == "default":  # not set: the model's own name
            name = Path(args.model_dir).name or str(args.model_dir)
        entries.append(ModelEntry(name, str(args.model_dir)))
    entries += [ModelEntry(name, reference) for name, reference in args.models or ()]
    if args.models_dir:
        entries += _models_in(args.models_dir)
    entries += config.get("models", [])
    by_name: dict[str, ModelEntry] = {}
    for entry in entries:
        if by_name.setdefault(entry.name, entry) is not entry:
            raise ValueError(f"two models are named {entry.name!r}; give one another name")
    ttl = args.idle_ttl if args.idle_ttl is not None else config.get("idle_ttl")
    for name in args.pinned_models or ():
        if name not in by_name:
            raise ValueError(f"--pin {name!r}: no such model; the models are "
                             f"{', '.join(by_name)}")
    if args.lora_modules:
        raise ValueError("--lora-modules: adapters belong to one model; give them in that "
                         "model's options (docs/several-models.md)")
    # Each model's options are read now, so a bad one fails at start, not at its first
    # request; the names of its adapters pick it, as with one model.
    own = {name: model_args(args, entry) for name, entry in by_name.items()}
    by_name = {name: _settled(entry, name in (args.pinned_models or ()), ttl,
                              own[name].task or "auto")
               for name, entry in by_name.items()}
    adapters = tuple((adapter, name) for name, parsed in own.items()
                     for adapter, _ in parsed.lora_modules or ())
    return ModelCatalog(
        by_name, adapters + tuple(args.model_aliases or ()),
        default=args.default_model or config.get("default_model"),
        max_loaded=args.max_loaded_models or config.get("max_loaded_models"),
        memory_bytes=args.models_memory or config.get("models_memory"),
    )  # fmt: skip


def model_args(args: argparse.Namespace, entry: ModelEntry) -> argparse.Namespace:
    """The `serve` arguments model `entry` loads with: the server's, with its reference and
    its own options."""
    parser = argparse.ArgumentParser(prog=f"options of model {entry.name!r}", add_help=False,
                                     exit_on_error=False)
    add_serve_arguments(parser)
    try:
        parsed = parser.parse_args(list(entry.options), namespace=copy.copy(args))
    except (argparse.ArgumentError, SystemExit) as exc:
        raise ValueError(f"model {entry.name!r}: bad options {' '.join(entry.options)!r}: "
                         f"{exc}") from None
    changed = sorted(name for name, value in vars(parsed).items()
                     if name != "model_dir" and getattr(args, name, None) != value)
    if server_wide := [name for name in changed if name not in PER_MODEL_OPTIONS]:
        raise ValueError(f"model {entry.name!r}: {', '.join(server_wide)} is the server's "
                         "option, not one model's; give it to `serve` itself")
    parsed.model_dir = entry.reference
    return parsed


def _settled(entry: ModelEntry, pinned: bool, ttl: float | None, task: Task) -> ModelEntry:
    return replace(entry, pinned=entry.pinned or pinned, task=task,
                   idle_ttl_s=entry.idle_ttl_s if entry.idle_ttl_s is not None else ttl)


def _models_in(folder: Path) -> list[ModelEntry]:
    if not folder.is_dir():
        raise ValueError(f"--models-dir {folder} is not a directory")
    found = [ModelEntry(path.name, str(path)) for path in sorted(folder.iterdir())
             if (path / "config.json").is_file()]
    found += [ModelEntry(path.stem, str(path)) for path in sorted(folder.glob("*.gguf"))]
    if not found:
        raise ValueError(f"--models-dir {folder} holds no model (a folder with config.json, "
                         "or a .gguf file)")
    return found


def _read_config(path: Path) -> dict:
    """The config file's settings, its models as ModelEntry; paths relative to its folder."""
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"--models-config {path}: not valid TOML: {exc}") from None
    _known_keys(raw, _CONFIG_KEYS, f"--models-config {path}")
    settings = {key: raw[key] for key in raw if key != "models"}
    if isinstance(settings.get("models_memory"), str):
        settings["models_memory"] = parse_size(settings["models_memory"])
    models = raw.get("models", {})
    if not isinstance(models, dict) or not models:
        raise ValueError(f"--models-config {path}: give each model a [models.NAME] table")
    settings["models"] = [_entry(name, table, path) for name, table in models.items()]
    return settings


def _entry(name: str, table: object, path: Path) -> ModelEntry:
    where = f"--models-config {path}: [models.{name}]"
    if not isinstance(table, dict) or not isinstance(table.get("path"), str):
        raise ValueError(f'{where} needs path = "a model dir, .gguf file or hub repo id"')
    _known_keys(table, _MODEL_KEYS, where)
    reference = table["path"]
    local = (path.parent / reference).expanduser()
    if not Path(reference).is_absolute() and local.exists():
        reference = str(local)
    aliases, options = table.get("aliases", []), table.get("options", [])
    if not all(isinstance(a, str) for a in aliases) or not all(
            isinstance(o, str) for o in options):
        raise ValueError(f"{where}: aliases and options are lists of strings")
    ttl = table.get("idle_ttl")
    if ttl is not None and (not isinstance(ttl, int | float) or ttl <= 0):
        raise ValueError(f"{where}: idle_ttl is a number of seconds above 0")
    return ModelEntry(name, reference, tuple(aliases), bool(table.get("pin", False)), ttl,
                      tuple(options))


def _known_keys(table: dict, known: frozenset[str], where: str) -> None:
    if unknown := sorted(set(table) - known):
        raise ValueError(f"{where}: unknown key {', '.join(unknown)} (known: "
                         f"{', '.join(sorted(known))})")


def _named(text: str) -> tuple[str, str]:
    name, _, reference = text.partition("=")
    if not name.strip() or not reference.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=MODEL, got {text!r}")
    return name.strip(), reference.strip()


def _alias(text: str) -> tuple[str, str]:
    pattern, _, name = text.partition("=")
    if not pattern.strip() or not name.strip():
        raise argparse.ArgumentTypeError(f"expected PATTERN=NAME, got {text!r}")
    return pattern.strip(), name.strip()
