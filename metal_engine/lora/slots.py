"""The loaded adapters of one model, stacked per targeted linear, and a step's rows -> slots.

Each targeted `Linear` gets a `LoraWeights`: its pairs of every loaded adapter stacked and
padded to the largest loaded rank, slot 0 all zeros (the base):

    a  [slots, in, r_max]     b  [slots, r_max, out]     (scale folded into b)

A step with adapter rows hands each linear a `LoraRows` (the slot of every packed row) and
the linear adds `(x @ a[slot]) @ b[slot]` per row with two gathered products
(`Ops.low_rank`): one forward serves every adapter at once, none runs per adapter. A step
with no adapter rows sets none, and every linear computes exactly as without adapters.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from metal_engine.lora.adapter_files import LoraAdapter
from metal_engine.models.layers import Linear

# The projections an adapter may target: attention's and the dense MLP's.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# From this many rows on, rows are sorted by slot: MLX's gather_mm then multiplies each
# slot's run of rows as one product (mlx-lm's SwitchGLU sorts its experts' rows from 64 on).
SORTED_ROWS = 64


@dataclass(frozen=True)
class LoraRows:
    """The adapter slot of each packed row; with `order`, the rows sorted by slot first
    (`slots` then in sorted order) and put back by `inverse`."""

    slots: mx.array  # [total_q] int32
    order: mx.array | None = None
    inverse: mx.array | None = None

    @classmethod
    def build(cls, slot_of_row: np.ndarray) -> LoraRows:
        if len(slot_of_row) < SORTED_ROWS:
            return cls(mx.array(slot_of_row, mx.int32))
        order = np.argsort(slot_of_row, kind="stable")
        return cls(mx.array(slot_of_row[order], mx.int32), mx.array(order, mx.int32),
                   mx.array(np.argsort(order), mx.int32))


class LoraWeights:
    """One linear's adapters, stacked by slot; a plain object, so the linear gains no
    parameter."""

    def __init__(self, slots: AdapterSlots, linear: Linear) -> None:
        self._slots = slots
        self.out_features, self.in_features = linear.weight.shape
        self.dtype = linear.weight.dtype
        self.pairs: dict[str, tuple[mx.array, mx.array]] = {}  # adapter -> (A, B), unpadded
        self.a = self.b = None

    @property
    def active(self) -> bool:
        return self._slots.rows is not None

    def added(self, ops, x: mx.array, y: mx.array) -> mx.array:
        """`y` (the linear's output for rows `x`) plus each row's adapter delta."""
        rows = self._slots.rows
        if rows is None:
            return y
        return y + ops.low_rank(x, self.a, self.b, rows).astype(y.dtype)

    def restack(self, names: Sequence[str], rank: int) -> None:
        """Stack the pairs of adapters `names` (slots 1..), zeros where one has none."""
        a = np.zeros((len(names) + 1, self.in_features, rank), np.float32)
        b = np.zeros((len(names) + 1, rank, self.out_features), np.float32)
        for slot, name in enumerate(names, start=1):
            if name in self.pairs:
                pair_a, pair_b = (np.asarray(t.astype(mx.float32)) for t in self.pairs[name])
                a[slot, :, : len(pair_a)] = pair_a.T
                b[slot, : len(pair_a)] = pair_b.T
        self.a, self.b = mx.array(a).astype(self.dtype), mx.array(b).astype(self.dtype)
        mx.eval(self.a, self.b)


class AdapterSlots:
    """The adapters loaded over `model`, at most `max_loras` of rank up to `max_rank`.
    Load and unload between steps (they restack the linears' weights)."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int) -> None:
        if max_loras < 1 or max_rank < 1:
            raise ValueError(f"--max-loras ({max_loras}) and --max-lora-rank ({max_rank}) must "
                             "be at least 1")
        self.model, self.max_loras, self.max_rank = model, max_loras, max_rank
        self.names: list[str] = []  # slot i + 1 serves names[i]
        self.ranks: dict[str, int] = {}
        self.fingerprints: dict[str, str] = {}  # by name: what its cached blocks are keyed by
        self.rows: LoraRows | None = None  # the rows of the step being built
        self._weights: list[LoraWeights] = []
        model.model.adapters = self  # the decoder's backend asks whether a step has adapters

    def load(self, adapter: LoraAdapter) -> None:
        """Serve `adapter` from a free slot; ValueError naming the problem (rank, a module
        the base lacks or that cannot take an adapter, shapes of another base, no slot)."""
        if adapter.name in self.ranks:
            raise ValueError(f"an adapter named {adapter.name!r} is already loaded")
        if len(self.names) >= self.max_loras:
            raise ValueError(f"cannot load adapter {adapter.name!r}: {self.max_loras} adapters "
                             "are loaded (--max-loras); unload one first")
        if adapter.rank > self.max_rank:
            raise ValueError(f"adapter {adapter.name!r} has rank {adapter.rank}, over "
                             f"--max-lora-rank {self.max_rank}")
        linears = {path: self._target(adapter, path, a, b)
                   for path, (a, b) in adapter.pairs.items()}
        for path, linear in linears.items():
            if linear.lora is None:
                linear.lora = LoraWeights(self, linear)
                self._weights.append(linear.lora)
            linear.lora.pairs[adapter.name] = adapter.pairs[path]
        self.names.append(adapter.name)
        self.ranks[adapter.name] = adapter.rank
        self.fingerprints[adapter.name] = adapter.fingerprint
        self._restack()

    def unload(self, name: str) -> None:
        if name not in self.ranks:
            raise ValueError(f"no adapter named {name!r} is loaded")
        self.names.remove(name)
        del self.ranks[name]
        del self.fingerprints[name]
        for weights in self._weights:
            weights.pairs.pop(name, None)
        self._restack()

    def step_rows(self, adapter_names: Sequence[str | None],
                  cu_seqlens_q: np.ndarray) -> LoraRows | None:
        """The slots of a step's rows, from each scheduled request's adapter (None: the
        base); None when no request of the step has one."""
        if all(name is None for name in adapter_names):
            return None
        slot_of_request = np.array([0 if n is None else self.slot(n) for n in adapter_names])
        return LoraRows.build(np.repeat(slot_of_request, np.diff(cu_seqlens_q)))

    def slot(self, name: str) -> int:
        if name not in self.ranks:
            raise ValueError(f"no adapter named {name!r} is loaded")
        return self.names.index(name) + 1

    @contextmanager
    def serving(self, rows: LoraRows | None) -> Iterator[None]:
        """Build a forward whose linears add the adapters of `rows`."""
        self.rows = rows
        try:
            yield
        finally:
            self.rows = None

    def _restack(self) -> None:
        rank = max(self.ranks.values(), default=1)
        for weights in self._weights:
            weights.restack(self.names, rank)

    def _target(self, adapter: LoraAdapter, path: str, a: mx.array, b: mx.array) -> Linear:
        """The base's linear at `path`, checked to take this pair."""
        module = _module_at(self.model, path)
        where = f"adapter {adapter.name!r} targets {path}"
        if ".experts." in f"{path}." or ".switch_mlp." in path:
            raise ValueError(f"{where}: adapters on a MoE's experts are not served; adapt "
                             f"its attention ({', '.join(TARGETS[:4])}) instead")
        if module is None:
            raise ValueError(f"{where}, which the base model does not have (an adapter of "
                             "another base?)")
        if path.rsplit(".", 1)[-1] not in TARGETS or type(module) is not Linear:
            kind = "quantized" if isinstance(module, nn.QuantizedLinear) else type(
                module).__name__
            raise ValueError(f"{where}: adapters are served on the float projections "
                             f"{', '.join(TARGETS)} of attention and dense MLPs, not on this "
                             f"{kind} module")
        out_features, in_features = module.weight.shape
        if a.ndim != 2 or b.ndim != 2 or a.shape != (a.shape[0], in_features) or b.shape != (
                out_features, a.shape[0]):
            raise ValueError(f"{where} with A {tuple(a.shape)} and B {tuple(b.shape)}, but its "
                             f"weight is {out_features}x{in_features}: an adapter of another "
                             "base")
        if a.shape[0] > self.max_rank:
            raise ValueError(f"{where} with rank {a.shape[0]}, over --max-lora-rank "
                             f"{self.max_rank}")
        return module


def _module_at(model: nn.Module, path: str) -> nn.Module | None:
    module = model
    for part in path.split("."):
        if isinstance(module, list):
            module = module[int(part)] if part.isdigit() and int(part) < len(module) else None
        elif isinstance(module, nn.Module):
            module = module.get(part)
        else:
            return None
        if module is None:
            return None
    return module if isinstance(module, nn.Module) else None
