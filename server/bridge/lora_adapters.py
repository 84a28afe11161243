"""The LoRA adapters a server serves, as its handlers see them: which `model` names pick
one, and loading or unloading one at run time. A load reads and checks the adapter's files
on a worker thread, beside the steps, and only installs its arrays on the engine thread,
between steps."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


class LoraAdapters:
    """Name -> path (None where unknown) of the engine's loaded adapters. Read and changed
    only on the handlers' event loop; the engine itself changes only through `run`, which
    runs a function on the engine thread between steps."""

    def __init__(self, engine: Any, run: Callable[[Callable[[], T]], T],
                 paths: Mapping[str, Path] | None = None) -> None:
        names = engine.adapter_names() if hasattr(engine, "adapter_names") else []
        paths = paths or {}
        self._engine, self._run = engine, run
        self._paths: dict[str, str | None] = {
            name: str(paths[name]) if name in paths else None for name in names
        }

    def served(self) -> dict[str, str | None]:
        return dict(self._paths)

    def lora_name(self, model: str | None) -> str | None:
        """The adapter a request's `model` picks; None (the base model) for any other name,
        as a single-model server answers whatever name a client sends."""
        return model if model in self._paths else None

    async def load(self, name: str, path: str) -> None:
        """ValueError saying why the engine cannot serve it (the server goes on serving)."""
        if not Path(path).exists():
            raise ValueError(f"adapter {name!r}: {path} does not exist")
        adapter = await asyncio.to_thread(self._engine.read_adapter, name, path)
        await asyncio.to_thread(self._run, lambda: self._engine.install_adapter(adapter))
        self._paths[name] = path

    async def unload(self, name: str) -> None:
        """ValueError if it is not loaded, or unfinished requests still use it."""
        await asyncio.to_thread(self._run, lambda: self._engine.unload_adapter(name))
        del self._paths[name]
