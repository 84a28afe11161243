"""The models a server of several offers, and which model a request's `model` names.

A request's name picks, in this order: a model by its name, an alias spelled out, the
first alias pattern (`fnmatch` globs such as `claude-*-haiku-*`) that matches, the default
model. No default: an unknown name is a 404 (`UnknownModel`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fnmatch import fnmatchcase

from metal_engine.config import Task

_GLOB = set("*?[")


@dataclass(frozen=True)
class ModelEntry:
    """One model: `name` as requests use it, `reference` what `serve` loads (a model dir, a
    .gguf file or a hub repo id; None: the bundled default model). `pinned`: never unloaded
    to make room; `idle_ttl_s`: unloaded after this long without requests (None: kept until
    the room is needed). `options`: `serve` options for this model alone (e.g.
    `--max-model-len 8192`); `task`: the `--task` they come to, with the server's (what its
    card lists before it loads)."""

    name: str
    reference: str | None
    aliases: tuple[str, ...] = ()
    pinned: bool = False
    idle_ttl_s: float | None = None
    options: tuple[str, ...] = ()
    task: Task = "auto"


class UnknownModel(LookupError):
    def __init__(self, requested: str | None, known: list[str]) -> None:
        asked = "no model" if requested is None else f"model {requested!r}"
        super().__init__(f"The request names {asked}, which this server does not serve; "
                         f"it serves {', '.join(known)} (GET /v1/models lists them).")
        self.requested = requested


@dataclass(frozen=True)
class ModelCatalog:
    """The models by name, in the order given, and how requests' names map onto them:
    `aliases` (pattern or name → model name; each entry's own aliases come first),
    `default` (where unknown names go; None: nowhere). `max_loaded` models at most are
    loaded at once (None: as many as `memory_bytes` holds); `memory_bytes` is what the
    loaded models' weights and KV caches may take together (None: what this machine has)."""

    entries: dict[str, ModelEntry]
    aliases: tuple[tuple[str, str], ...] = ()
    default: str | None = None
    max_loaded: int | None = None
    memory_bytes: int | None = None
    _exact: dict[str, str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.entries:
            raise ValueError("no models to serve: give --model NAME=PATH, --models-dir or "
                             "--models-config")
        all_aliases = [(a, e.name) for e in self.entries.values() for a in e.aliases]
        all_aliases += list(self.aliases)
        object.__setattr__(self, "aliases", tuple(all_aliases))
        for name in self.entries:
            if _GLOB & set(name):
                raise ValueError(f"model name {name!r} has glob characters (*?[); give it a "
                                 "plain name and the pattern as an alias")
        exact: dict[str, str] = {}
        for alias, target in self.aliases:
            if target not in self.entries:
                raise ValueError(f"alias {alias!r} names model {target!r}, which is not one "
                                 f"of the models: {', '.join(self.entries)}")
            if alias in self.entries and alias != target:
                raise ValueError(f"alias {alias!r} is also a model's name; rename one")
            if not _GLOB & set(alias) and exact.setdefault(alias, target) != target:
                raise ValueError(f"alias {alias!r} names two models: {exact[alias]!r} "
                                 f"and {target!r}")
        object.__setattr__(self, "_exact", exact)
        if self.default is not None and self.default not in self.entries:
            raise ValueError(f"--default-model {self.default!r} is not one of the models: "
                             f"{', '.join(self.entries)}")
        if self.max_loaded is not None and self.max_loaded < 1:
            raise ValueError(f"--max-loaded-models must be at least 1, got {self.max_loaded}")

    def resolve(self, requested: str | None, use_default: bool = True) -> str:
        """The model name a request's `model` field stands for (falling back on the default
        model if `use_default`); `UnknownModel` if none."""
        if requested is not None:
            if requested in self.entries:
                return requested
            if requested in self._exact:
                return self._exact[requested]
            for pattern, target in self.aliases:
                if fnmatchcase(requested, pattern):
                    return target
        if use_default and self.default is not None:
            return self.default
        raise UnknownModel(requested, list(self.entries))

    def names_of(self, name: str) -> list[str]:
        """The names that pick model `name`: its own, then its aliases."""
        return [name, *(alias for alias, target in self.aliases if target == name)]
