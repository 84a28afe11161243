"""One checked dispatcher for every Metal kernel family (paged attention, gated delta).

A family's kernels serve a call only on Metal (or under an override, in tests) and only for a
*variant* (what its kernels are specialised on) that passed its first-use check: built and
run on a small problem against the reference. A variant that fails the check, or whose call
raises later, falls back to the reference alone: one warning, and the verdict lasts the
process (`fallbacks()`; /metrics counts them, the dashboard and the startup log show them).

The check compiles the launches of its small problem, but serving meets others: a
prefill-only step's MERGE=0, 64-bit offsets into a large pool, a metadata input past MLX's
constant-space size (another kernel source). Those compile when their graph is evaluated,
inside the runner's `mx.async_eval`, where no `try` around the kernel call sees them. So
kernels built on `recorded(factory)` report each launch's configuration, and a call that
made one no evaluated graph has run yet is evaluated right there, inside the `try`: if it
fails, its variant falls back and the same call is served by the reference, with everything
before it in the step intact. The warm-up runs these first calls before the server is up.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, NamedTuple, TypeVar

import mlx.core as mx

from kernels_metal.plan import MIN_METADATA_ELEMENTS

# `call`'s memo of served launches is cleared past this many (shapes vary with the batch).
MAX_SERVED = 256
K = TypeVar("K")  # a family's kernels: a callable built on a `metal_kernel` factory
V = TypeVar("V", bound=Hashable)  # a family's variant


class Fallback(NamedTuple):
    """A variant served by the reference because its kernels failed."""

    kernel: str  # the family: "attention", "gated delta"
    variant: str
    reason: str


@dataclass
class Verdicts:
    """Variants that passed their check, those that fell back (and why), and the launch
    configurations that have run in an evaluated graph."""

    passed: set = field(default_factory=set)
    fallbacks: dict = field(default_factory=dict)
    proven: set = field(default_factory=set)


def launch_key(name: str, call: dict) -> tuple:
    """What MLX compiles a `metal_kernel` launch from, besides its source: the template, the
    threadgroup (checked against the pipeline's limit), each input's type and address space,
    and the output types."""
    inputs = tuple((str(getattr(x, "dtype", type(x))), getattr(x, "ndim", 0) == 0,
                    getattr(x, "size", 1) < MIN_METADATA_ELEMENTS) for x in call["inputs"])
    template = tuple((n, str(v)) for n, v in call.get("template") or ())
    return (name, template, tuple(call["threadgroup"]), inputs,
            tuple(str(d) for d in call["output_dtypes"]))


class _LaunchLog:
    """Launch keys of recorded kernels, taken while the dispatcher resolves a call."""

    def __init__(self) -> None:
        self.keys: list = []
        self.active = False


class _RecordedKernel:
    """A `metal_kernel` that reports each launch's configuration while its log is active."""

    def __init__(self, kernel: Callable, name: str, log: _LaunchLog) -> None:
        self._kernel, self._name, self._log = kernel, name, log

    def __call__(self, **call):
        if self._log.active:
            self._log.keys.append(launch_key(self._name, call))
        return self._kernel(**call)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._kernel, attr)


class CheckedDispatch(Generic[K, V]):
    """The dispatch state of one kernel family.

    `build(factory)` makes the family's kernels on a `metal_kernel` factory (at the first
    Metal call); `check(kernels, variant, *args)` is the first-use check: None, or why the
    variant cannot use them. Single-threaded, as the engine is.
    """

    def __init__(self, family: str, build: Callable[[Callable], K],
                 check: Callable[..., str | None], log: logging.Logger) -> None:
        self.family = family
        self._build, self._check, self._log = build, check, log
        self.kernels: K | None = None  # built at the first Metal call
        self.verdicts = Verdicts()
        self.override: K | None = None  # `use`
        self.override_verdicts: Verdicts | None = None  # None: the override is not checked
        self.metal: bool | None = None  # mx.metal.is_available(), asked once
        self._launches = _LaunchLog()
        # Changes whenever a route may: a fallback, an override set or lifted. Routes a step
        # keeps (`serve`) are keyed by it.
        self.generation = 0
        self._served: dict[tuple, K] = {}  # `call`'s (variant, launches) -> kernels
        self._served_generation = 0

    def recorded(self, factory: Callable) -> Callable:
        """`factory` whose kernels report their launches to this dispatcher."""
        def make(**spec):
            return _RecordedKernel(factory(**spec), spec["name"], self._launches)
        return make

    @property
    def active_verdicts(self) -> Verdicts:
        return self.verdicts if self.override is None else (self.override_verdicts or Verdicts())

    def on_kernels(self) -> bool:
        """Whether kernels may serve here: Metal, or an override."""
        if self.override is not None:
            return True
        if self.metal is None:
            self.metal = mx.metal.is_available()
        return self.metal

    def serve(self, variant: V, prepare: Callable[[K], Callable], reference: Callable,
              args: tuple, check_args: tuple = ()) -> tuple[Any, Callable]:
        """`(output, how)`: `prepare(kernels)(*args)` where the kernels serve `variant`, else
        `reference(*args)`; `how` is the function that served, for later calls of the step
        that would make the same launches (its layers of one kind). A call that raises (or
        makes a new launch that fails when evaluated) falls the variant back and is served by
        `reference`. An unchecked override's errors propagate."""
        route = self._route(variant, check_args)
        if route is None:
            return reference(*args), reference
        kernels, verdicts = route
        try:
            with self._recording():
                served = prepare(kernels)
                out = served(*args)
                new = [key for key in self._launches.keys if key not in verdicts.proven] \
                    if verdicts is not None else []
            if new:
                mx.eval(out)
                verdicts.proven.update(new)
            return out, served
        except Exception as exc:  # compile errors and thread limits surface at evaluation
            if verdicts is None:
                raise
            self.fall_back(verdicts, variant, describe(exc))
        return reference(*args), reference

    def call(self, variant: V, run: Callable[[K], Any], reference: Callable[[], Any],
             check_args: tuple = (), launches: Hashable = None) -> Any:
        """`serve` of one call: `run(kernels)` or `reference()`.

        `launches`: what besides the variant decides the launches `run` makes (its shapes).
        A call whose variant and `launches` the kernels served since the routes last changed
        runs on them directly: its launches are proven, and a step's layers of one kind (a
        hybrid model's linear-attention layers) then skip the route and the recording."""
        key = (variant, launches)
        kernels = self.proven(key) if launches is not None else None
        if kernels is not None:
            return run(kernels)
        used = []

        def prepare(kernels: K) -> Callable[[], Any]:
            used.append(kernels)
            return lambda: run(kernels)

        out, how = self.serve(variant, prepare, reference, (), check_args)
        if launches is not None and how is not reference:
            self.keep(key, used[0])
        return out

    def proven(self, key: Hashable) -> K | None:
        """The kernels that served a call of `key` (a caller's name for what decides the
        variant and the launches) since the routes last changed, or None. Those launches
        are proven: another call of `key` may run on the kernels without the route."""
        if self._served_generation != self.generation or len(self._served) > MAX_SERVED:
            self._served.clear()
            self._served_generation = self.generation
        return self._served.get(key)

    def keep(self, key: Hashable, kernels: K) -> None:
        """Remember that `kernels` served a call of `key` (`serve` routed it to them)."""
        self._served[key] = kernels

    @contextlib.contextmanager
    def _recording(self) -> Iterator[None]:
        self._launches.keys.clear()
        self._launches.active = True
        try:
            yield
        finally:
            self._launches.active = False

    def _route(self, variant: V, check_args: tuple) -> tuple[K, Verdicts | None] | None:
        """(kernels, verdicts to record a failure in; None for an unchecked override), or
        None: the reference serves."""
        if not self.on_kernels():
            return None
        if self.override is not None and self.override_verdicts is None:
            return self.override, None
        verdicts = self.active_verdicts
        if variant in verdicts.fallbacks:
            return None
        kernels = self.override if self.override is not None else self._built()
        if variant not in verdicts.passed:
            with self._recording():
                reason = self._check(kernels, variant, *check_args)
            if reason is not None:
                self.fall_back(verdicts, variant, reason)
                return None
            verdicts.passed.add(variant)
            verdicts.proven.update(self._launches.keys)  # the check evaluated them
        return kernels, verdicts

    def _built(self) -> K:
        if self.kernels is None:
            self.kernels = self._build(self.recorded(mx.fast.metal_kernel))
        return self.kernels

    def fall_back(self, verdicts: Verdicts, variant: V, reason: str) -> None:
        verdicts.fallbacks[variant] = reason
        self.generation += 1
        self._log.warning("Metal %s kernels off for %s (other variants keep them): %s",
                          self.family, _name(variant), reason)

    @contextlib.contextmanager
    def use(self, kernels: K, first_use_check: bool = False) -> Iterator[None]:
        """Serve every supported call with `kernels` (e.g. on the emulator in tests). With
        `first_use_check` each variant is checked and falls back as on a Mac, with verdicts
        of its own for the duration; without, the kernels' errors propagate."""
        previous = self.override, self.override_verdicts
        self.override = kernels
        self.override_verdicts = Verdicts() if first_use_check else None
        self.generation += 1
        try:
            yield
        finally:
            self.override, self.override_verdicts = previous
            self.generation += 1

    def fallbacks(self) -> list[Fallback]:
        return [Fallback(self.family, _name(v), why)
                for v, why in dict(self.active_verdicts.fallbacks).items()]


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _name(variant: Hashable) -> str:
    return getattr(variant, "name", str(variant))
