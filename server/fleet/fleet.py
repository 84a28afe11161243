"""Which models are loaded: load on first use, unload the least recently used idle one when
another needs the room, unload after an idle TTL.

    acquire(name) ──loaded──▶ its app (in_flight + 1) ─ … ─ release(name)
         └─unloaded─▶ [one load at a time] plan → make room (unload LRU idle, unpinned) → load

Loads run one at a time, each off the event loop (`asyncio.to_thread`), so that every room
decision sees the memory the previous load took; requests to other loaded models are served
meanwhile. A model is idle while no request of it is in flight; only idle models are
unloaded. This module decides; `plan`, `load` and `unload` (server.fleet.serve) do.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

from metal_engine.cache.memory_plan import size
from server.fleet.catalog import ModelCatalog, ModelEntry

log = logging.getLogger("metal_serve")

M = TypeVar("M")  # a loaded model, as `load` makes it
ModelState = Literal["unloaded", "loading", "loaded"]


class ModelUnavailable(RuntimeError):
    """A model cannot be loaded now (`retry_after_s`: it may once others go idle) or at all
    (None)."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class Planned:
    """What loading a model will take: `memory_bytes` of weights and KV, and whatever its
    loader needs (`details`: its config and memory plan)."""

    memory_bytes: int
    details: Any = None


@dataclass
class _Slot(Generic[M]):
    entry: ModelEntry
    model: M | None = None
    memory_bytes: int = 0  # held while loaded (and while loading)
    loading: asyncio.Task[None] | None = None
    in_flight: int = 0
    last_used: float = 0.0
    loads: int = 0
    last_error: str | None = None

    @property
    def state(self) -> ModelState:
        if self.model is not None:
            return "loaded"
        return "loading" if self.loading is not None else "unloaded"


@dataclass(frozen=True)
class ModelStatus:
    """One model as `/v1/models` and the dashboard show it."""

    name: str
    state: ModelState
    pinned: bool
    in_flight: int
    memory_bytes: int
    idle_s: float | None
    loads: int
    last_error: str | None


class ModelFleet(Generic[M]):
    """The catalog's models and which are loaded; event loop only.

    `plan(entry)` (blocking) says what loading `entry` takes, `load(entry, planned)`
    (blocking) loads it, `unload(model)` (blocking) frees it; each runs off the event loop.
    `memory_bytes`: what loaded models may hold together.
    """

    def __init__(self, catalog: ModelCatalog, memory_bytes: int,
                 plan: Callable[[ModelEntry], Planned], load: Callable[[ModelEntry, Planned], M],
                 unload: Callable[[M], None], clock: Callable[[], float] = time.monotonic,
                 ) -> None:  # fmt: skip
        self.catalog = catalog
        self.memory_bytes = memory_bytes
        self._plan, self._load, self._unload, self._clock = plan, load, unload, clock
        self._slots: dict[str, _Slot[M]] = {name: _Slot(entry)
                                            for name, entry in catalog.entries.items()}
        self._room = asyncio.Lock()  # one load (and its room decisions) at a time

    # ------------------------------------------------------------------ requests

    async def acquire(self, name: str) -> M:
        """Model `name`, loaded (loading it first if need be), counted in flight until
        `release(name)`. `ModelUnavailable` if it cannot be loaded."""
        slot = self._slots[name]
        while slot.model is None:
            await self.load(name)
        slot.in_flight += 1
        slot.last_used = self._clock()
        return slot.model

    def release(self, name: str) -> None:
        slot = self._slots[name]
        slot.in_flight -= 1
        slot.last_used = self._clock()

    def loaded(self) -> list[tuple[str, M]]:
        return [(name, slot.model) for name, slot in self._slots.items()
                if slot.model is not None]

    def status(self) -> list[ModelStatus]:
        now = self._clock()
        return [ModelStatus(name, slot.state, slot.entry.pinned, slot.in_flight,
                            slot.memory_bytes,
                            now - slot.last_used if slot.model is not None else None,
                            slot.loads, slot.last_error)
                for name, slot in self._slots.items()]  # fmt: skip

    # ------------------------------------------------------------------ loading

    async def load(self, name: str) -> None:
        """Load model `name` if it is not (waiting for a load under way)."""
        slot = self._slots[name]
        if slot.model is not None:
            return
        if slot.loading is None:
            slot.loading = asyncio.create_task(self._load_one(slot))
        task = slot.loading
        await asyncio.shield(task)  # a caller that leaves does not cancel others' load

    async def _load_one(self, slot: _Slot[M]) -> None:
        entry = slot.entry
        try:
            async with self._room:
                planned = await asyncio.to_thread(self._plan, entry)
                if planned.memory_bytes > self.memory_bytes:
                    raise ModelUnavailable(
                        f"model {entry.name!r} needs {size(planned.memory_bytes)} of weights "
                        f"and KV cache, more than the {size(self.memory_bytes)} the models "
                        "may take together (--models-memory); give it a smaller "
                        "--kv-cache-memory or --max-model-len in its options")
                await self._make_room(entry, planned.memory_bytes)
                slot.memory_bytes = planned.memory_bytes
                started = self._clock()
                try:
                    slot.model = await asyncio.to_thread(self._load, entry, planned)
                except BaseException:
                    slot.memory_bytes = 0
                    raise
                slot.loads += 1
                slot.last_used = self._clock()
                slot.last_error = None
                log.info("model %r loaded in %.1f s (%s)", entry.name,
                         slot.last_used - started, size(planned.memory_bytes))
        except ModelUnavailable as exc:
            slot.last_error = str(exc)
            raise
        except (RuntimeError, ValueError, OSError) as exc:
            slot.last_error = f"model {entry.name!r} failed to load: {exc}"
            log.error("%s", slot.last_error)
            raise ModelUnavailable(slot.last_error) from exc
        finally:
            slot.loading = None

    async def _make_room(self, entry: ModelEntry, needed: int) -> None:
        """Unload idle, unpinned models, least recently used first, until `needed` more
        bytes fit and one more model is allowed; `ModelUnavailable` if they cannot."""
        limit = self.catalog.max_loaded
        while True:
            loaded = [s for s in self._slots.values() if s.model is not None]
            held = sum(s.memory_bytes for s in loaded)
            if held + needed <= self.memory_bytes and (limit is None or len(loaded) < limit):
                return
            idle = [s for s in loaded if s.in_flight == 0 and not s.entry.pinned]
            if not idle:
                busy = ", ".join(f"{s.entry.name} ({size(s.memory_bytes)}"
                                 f"{', pinned' if s.entry.pinned else ''})" for s in loaded)
                raise ModelUnavailable(
                    f"model {entry.name!r} needs {size(needed)}; the loaded models ({busy}) "
                    f"hold {size(held)} of {size(self.memory_bytes)}"
                    + (f" and {len(loaded)} of {limit} model slots" if limit else "")
                    + ", and none is idle and unpinned; retry once their requests finish",
                    retry_after_s=5.0)
            await self._unload_slot(min(idle, key=lambda s: s.last_used),
                                    f"to make room for {entry.name!r}")

    # ------------------------------------------------------------------ unloading

    async def unload(self, name: str) -> bool:
        """Unload model `name` (an admin's request, pinned or not) once idle; False if it
        was not loaded. `ModelUnavailable` while requests of it are in flight."""
        slot = self._slots[name]
        async with self._room:
            if slot.model is None:
                return False
            if slot.in_flight:
                raise ModelUnavailable(f"model {name!r} has {slot.in_flight} requests in "
                                       "flight; unload it once they finish", retry_after_s=5.0)
            await self._unload_slot(slot, "as asked")
            return True

    async def unload_expired(self) -> None:
        """Unload each idle, unpinned model unused for longer than its TTL."""
        now = self._clock()
        for slot in self._slots.values():
            ttl = slot.entry.idle_ttl_s
            if (slot.model is not None and ttl is not None and not slot.entry.pinned
                    and slot.in_flight == 0 and now - slot.last_used > ttl):
                async with self._room:
                    if slot.model is not None and slot.in_flight == 0:
                        await self._unload_slot(slot, f"idle for over {ttl:g} s")

    async def watch_idle(self, period_s: float = 1.0) -> None:
        """`unload_expired` every `period_s`, until cancelled."""
        if not any(e.idle_ttl_s for e in self.catalog.entries.values()):
            return
        while True:
            await asyncio.sleep(period_s)
            await self.unload_expired()

    async def _unload_slot(self, slot: _Slot[M], why: str) -> None:
        model, slot.model = slot.model, None  # new requests load it afresh from now on
        log.info("unloading model %r %s (%s)", slot.entry.name, why, size(slot.memory_bytes))
        try:
            await asyncio.to_thread(self._unload, model)
        finally:
            slot.memory_bytes = 0

    async def close(self) -> None:
        """Unload every model (server shutdown)."""
        for slot in self._slots.values():
            if slot.model is not None:
                await self._unload_slot(slot, "at shutdown")

    def abort_all(self) -> None:
        """End every live request of every loaded model (a drain's last resort)."""
        for _, model in self.loaded():
            model.abort_all()  # type: ignore[attr-defined]
