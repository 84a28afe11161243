"""The loaded adapters of one model, stacked per targeted linear, and a step's rows -> slots.

Each targeted linear (float or quantized `Linear`, or a MoE's stacked `SwitchLinear`) gets a
`LoraWeights`: its pairs of every loaded adapter stacked and padded to the largest loaded
rank, slot 0 all zeros (the base). A linear's stack is indexed by slot; a SwitchLinear's by
(expert, slot), expert-major, so rows sorted by expert stay sorted by that index:

    a  [experts * slots, in, r_max]     b  [experts * slots, r_max, out]   (scale folded in b)
       (experts = 1 for a plain linear)     index of (expert e, slot s) = e * slots + s

A step with adapter rows hands each linear a `LoraRows` (the slot of every packed row) and
the linear adds `(x @ a[index]) @ b[index]` per row (per row and chosen expert) with two
gathered products (`Ops.low_rank`): one forward serves every adapter at once, none runs per
adapter. The CPU backend's compiled host layer steps add the same stacks' deltas in their
own loop (kernels_metal.cpu.low_rank). A step with no adapter rows sets none, and every
linear computes exactly as without adapters.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from metal_engine.lora.adapter_files import LoraAdapter, names_another_base
from metal_engine.models.layers import Linear, QuantizedLinear
from metal_engine.models.moe import QuantizedSwitchLinear, SwitchLinear

# The projections an adapter may target: attention's, the dense MLP's and the experts'.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTABLE = (Linear, QuantizedLinear, SwitchLinear, QuantizedSwitchLinear)
# From this many rows on, rows are sorted by slot: MLX's gather_mm then multiplies each
# slot's run of rows as one product (mlx-lm's SwitchGLU sorts its experts' rows from 64 on).
SORTED_ROWS = 64
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoraRows:
    """The adapter slot of each packed row (`of_row`, and `host` as numpy for the CPU's host
    loops); with `order`, the rows sorted by slot first (`slots` in that order) and put back
    by `inverse`."""

    host: np.ndarray  # [total_q] int
    of_row: mx.array  # [total_q] int32
    slots: mx.array  # [total_q] int32: of_row, or of_row[order]
    order: mx.array | None = None
    inverse: mx.array | None = None

    @classmethod
    def build(cls, slot_of_row: np.ndarray) -> LoraRows:
        of_row = mx.array(slot_of_row, mx.int32)
        if len(slot_of_row) < SORTED_ROWS:
            return cls(slot_of_row, of_row, of_row)
        order = np.argsort(slot_of_row, kind="stable")
        return cls(slot_of_row, of_row, mx.array(slot_of_row[order], mx.int32),
                   mx.array(order, mx.int32), mx.array(np.argsort(order), mx.int32))


def linear_shape(linear: nn.Module) -> tuple[int, int, int]:
    """(experts, out, in) of a targetable linear (experts 1 for a plain one)."""
    weight = linear.weight
    experts, out = (1, weight.shape[0]) if weight.ndim == 2 else weight.shape[:2]
    packed = "scales" in linear  # quantized: the weight holds packed codes
    return experts, out, linear.scales.shape[-1] * linear.group_size if packed else \
        weight.shape[-1]


class LoraWeights:
    """One linear's adapters, stacked by slot; a plain object, so the linear gains no
    parameter."""

    def __init__(self, slots: AdapterSlots, linear: nn.Module) -> None:
        self._slots = slots
        self.experts, self.out_features, self.in_features = linear_shape(linear)
        self.dtype = (linear.scales if "scales" in linear else linear.weight).dtype
        self.pairs: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # adapter -> (A, B)
        self.a = self.b = None
        self.num_slots = 1

    @property
    def active(self) -> bool:
        return self._slots.rows is not None

    def added(self, ops, x: mx.array, y: mx.array) -> mx.array:
        """A plain linear's `y` (its output for rows `x`) plus each row's adapter delta."""
        rows = self._slots.rows
        if rows is None:
            return y
        sort = rows.order is not None
        x = (x[rows.order] if sort else x)[:, None, :]
        delta = ops.low_rank(x, self.a, self.b, rows.slots, sort)[:, 0]
        return y + (delta[rows.inverse] if sort else delta).astype(y.dtype)

    def expert_index(self, experts: mx.array) -> mx.array:
        """The stack index of each (row, chosen expert) of `experts [rows, k]` this step."""
        slots = self._slots.rows.of_row.astype(experts.dtype)
        return experts * self.num_slots + slots[:, None]

    def restack(self, names: Sequence[str], rank: int) -> None:
        """Stack the pairs of adapters `names` (slots 1..), zeros where one has none."""
        self.num_slots = len(names) + 1
        shape = (self.experts, self.num_slots)
        a = np.zeros((*shape, self.in_features, rank), np.float32)
        b = np.zeros((*shape, rank, self.out_features), np.float32)
        for slot, name in enumerate(names, start=1):
            if name in self.pairs:
                pair_a, pair_b = self.pairs[name]
                if pair_a.ndim == 2:  # a plain linear's: one "expert"
                    pair_a, pair_b = pair_a[None], pair_b[None]
                r, count = pair_a.shape[1], len(pair_a)
                a[:count, slot, :, :r] = pair_a.transpose(0, 2, 1)
                b[:count, slot, :r] = pair_b.transpose(0, 2, 1)
        self.a = mx.array(a.reshape(-1, self.in_features, rank)).astype(self.dtype)
        self.b = mx.array(b.reshape(-1, rank, self.out_features)).astype(self.dtype)
        mx.eval(self.a, self.b)


class AdapterSlots:
    """The adapters loaded over `model`, at most `max_loras` of rank up to `max_rank`.
    Load and unload between steps (they restack the linears' weights). `model_names`: what
    the served model is called, if known (an adapter naming another base is warned of)."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int,
                 model_names: Sequence[str] = ()) -> None:
        if max_loras < 1 or max_rank < 1:
            raise ValueError(f"--max-loras ({max_loras}) and --max-lora-rank ({max_rank}) must "
                             "be at least 1")
        self.model, self.max_loras, self.max_rank = model, max_loras, max_rank
        self.model_names = tuple(model_names)
        self.names: list[str] = []  # slot i + 1 serves names[i]
        self.ranks: dict[str, int] = {}
        self.fingerprints: dict[str, str] = {}  # by name: what its cached blocks are keyed by
        self.rows: LoraRows | None = None  # the rows of the step being built
        self.version = 0  # changes whenever the stacks do (what host loops hold views of)
        self._weights: list[LoraWeights] = []
        model.model.adapters = self  # the decoder's backend asks whether a step has adapters

    def check(self, adapter: LoraAdapter) -> dict[str, nn.Module]:
        """The linears `adapter` targets; ValueError naming the problem (rank, a module the
        base lacks or that cannot take an adapter, shapes of another base, no slot). Reads
        only shapes: safe beside a step, on another thread."""
        if adapter.name in self.ranks:
            raise ValueError(f"an adapter named {adapter.name!r} is already loaded")
        if len(self.names) >= self.max_loras:
            raise ValueError(f"cannot load adapter {adapter.name!r}: {self.max_loras} adapters "
                             "are loaded (--max-loras); unload one first")
        if adapter.rank > self.max_rank:
            raise ValueError(f"adapter {adapter.name!r} has rank {adapter.rank}, over "
                             f"--max-lora-rank {self.max_rank}")
        return {path: self._target(adapter, path, a, b) for path, (a, b) in adapter.pairs.items()}

    def load(self, adapter: LoraAdapter) -> None:
        """Serve `adapter` from a free slot (checked first, as `check`); between steps."""
        targets = self.check(adapter)
        if names_another_base(adapter, self.model_names):
            # Only a warning: names change across conversions; the shapes were checked.
            log.warning("LoRA adapter %r names %r as its base, not the served model (%s): "
                        "its outputs are wrong if it was trained on another base", adapter.name,
                        adapter.base_model, ", ".join(self.model_names))
        for path, linear in targets.items():
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
        self.version += 1

    def _target(self, adapter: LoraAdapter, path: str, a: np.ndarray,
                b: np.ndarray) -> nn.Module:
        """The base's linear at `path`, checked to take this pair."""
        module = _module_at(self.model, path)
        where = f"adapter {adapter.name!r} targets {path}"
        if module is None:
            raise _not_in_base(self.model, adapter.name, path)
        if path.rsplit(".", 1)[-1] not in TARGETS or not isinstance(module, ADAPTABLE):
            raise ValueError(f"{where}: adapters are served on the projections "
                             f"{', '.join(TARGETS)} of attention, MLPs and experts, not on "
                             f"this {type(module).__name__} module")
        experts, out_features, in_features = linear_shape(module)
        stacked = isinstance(module, (SwitchLinear, QuantizedSwitchLinear))
        want = 3 if stacked else 2
        if a.ndim != want or b.ndim != want:
            raise ValueError(f"{where} with {a.ndim}-D pairs, but it takes {want}-D ones ("
                             f"{'a stack of experts' if stacked else 'one linear'}): an adapter "
                             "of another base")
        count, rank = (len(a) if stacked else 1), a.shape[-2]
        fits = (a.shape[-1] == in_features and b.shape[-2:] == (out_features, rank)
                and count <= experts and b.shape[:-2] == a.shape[:-2])
        if not fits:
            weight = f"{experts}x{out_features}x{in_features}" if stacked else \
                f"{out_features}x{in_features}"
            raise ValueError(f"{where} with A {tuple(a.shape)} and B {tuple(b.shape)}, but its "
                             f"weight is {weight}: an adapter of another base")
        if rank > self.max_rank:
            raise ValueError(f"{where} with rank {rank}, over --max-lora-rank {self.max_rank}")
        return module


def _not_in_base(model: nn.Module, name: str, path: str) -> ValueError:
    """Why adapter `name` cannot target `path`, a module the base lacks."""
    if ".switch_mlp." in path and model.config.model_type == "gpt_oss":
        # PEFT's pairs over fused experts, read as gate rows then up rows; GPT-OSS's
        # gate_up_proj interleaves gate and up columns, which the split would mix.
        experts = f"{path.split('.switch_mlp.')[0]}.experts"
        return ValueError(f"adapter {name!r} targets {experts} (PEFT's fused gate_up_proj / "
                          "down_proj): GPT-OSS's fused experts take no adapters; serve one on "
                          "its attention projections")
    return ValueError(f"adapter {name!r} targets {path}, which the base model does not have "
                      "(an adapter of another base?)")


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
