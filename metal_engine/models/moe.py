"""Mixture-of-experts layers for the packed `[total_q, hidden]` rows of a step.

Expert weights are stored stacked, `[experts, out, in]` under `switch_mlp.*` (mlx-lm's layout,
so its quantized checkpoints load as they are). Two ways to run the chosen experts:

- `gather`: gathered matmuls (`mx.gather_mm` / `mx.gather_qmm`), one product per (token,
  expert) pair, the pairs sorted by expert once there are enough of them that reading each
  expert's weights once pays for the sort. No host sync; the way on Metal.
- `grouped`: one BLAS product per expert that any row chose, over those rows, in numpy on
  the host. The CPU backend's way: its gather_mm copies the (transposed) stack out before
  multiplying, about twice as slow at one row and more with more (see docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from kernels_metal.cpu_math import host_linear, on_cpu
from metal_engine.models.moe_config import MoeConfig

# (token, expert) pairs from which sorting by expert beats gathering in token order.
SORT_PAIRS = 64
Activation = Callable[[mx.array, mx.array], mx.array]  # (gate, up) -> hidden
Dispatch = Literal["gather", "grouped"]


class SwitchLinear(nn.Module):
    """One linear layer per expert: `weight [experts, out, in]`, optional `bias [experts, out]`."""

    def __init__(self, in_dims: int, out_dims: int, num_experts: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = mx.zeros((num_experts, out_dims, in_dims))
        if bias:
            self.bias = mx.zeros((num_experts, out_dims))

    def __call__(self, x: mx.array, experts: mx.array, sorted_experts: bool) -> mx.array:
        """x `[..., 1, in]`, experts `[...]` -> `[..., 1, out]`, row i through expert i."""
        out = mx.gather_mm(x, self.weight.swapaxes(-1, -2), rhs_indices=experts,
                           sorted_indices=sorted_experts)  # fmt: skip
        return out if "bias" not in self else out + mx.expand_dims(self.bias[experts], -2)

    def expert(self, x: np.ndarray, e: int) -> np.ndarray:
        """x `[rows, in]` through expert `e` alone, on the host (float32)."""
        # Index the zero-copy view of the whole stack: an MLX slice would be copied out.
        out = host_linear(x, np.asarray(self.weight)[e])
        return out if "bias" not in self else out + np.asarray(self.bias)[e]

    def to_quantized(self, group_size: int = 64, bits: int = 4, mode: str = "affine",
                     **_: object) -> QuantizedSwitchLinear:
        return QuantizedSwitchLinear(self, group_size, bits, mode)


class QuantizedSwitchLinear(nn.Module):
    """SwitchLinear with each expert's weight quantized as `mx.quantize` packs it."""

    def __init__(self, source: SwitchLinear, group_size: int, bits: int, mode: str) -> None:
        super().__init__()
        self.group_size, self.bits, self.mode = group_size, bits, mode
        packed = mx.quantize(source.weight, group_size, bits, mode=mode)
        self.weight, self.scales = packed[0], packed[1]
        if len(packed) > 2:
            self.biases = packed[2]
        if "bias" in source:
            self.bias = source.bias
        self.freeze()

    def __call__(self, x: mx.array, experts: mx.array, sorted_experts: bool) -> mx.array:
        out = mx.gather_qmm(x, self.weight, self.scales, self.get("biases"), rhs_indices=experts,
                            transpose=True, group_size=self.group_size, bits=self.bits,
                            mode=self.mode, sorted_indices=sorted_experts)  # fmt: skip
        return out if "bias" not in self else out + mx.expand_dims(self.bias[experts], -2)

    def expert(self, x: np.ndarray, e: int) -> np.ndarray:
        biases = self.biases[e] if "biases" in self else None
        weight = mx.dequantize(self.weight[e], self.scales[e], biases, self.group_size,
                               self.bits, mode=self.mode)  # fmt: skip
        out = host_linear(x, np.asarray(weight.astype(mx.float32)))
        return out if "bias" not in self else out + np.asarray(self.bias[e].astype(mx.float32))


class SwitchGLU(nn.Module):
    """The experts: `down(act(gate(x), up(x)))`, each through its own weights. `dispatch`:
    how they run (see the module docstring); None picks by backend and batch."""

    dispatch: Dispatch | None = None

    def __init__(self, hidden: int, inner: int, num_experts: int, activation: Activation,
                 bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = SwitchLinear(hidden, inner, num_experts, bias)
        self.up_proj = SwitchLinear(hidden, inner, num_experts, bias)
        self.down_proj = SwitchLinear(inner, hidden, num_experts, bias)
        self._act = activation

    def __call__(self, x: mx.array, experts: mx.array) -> mx.array:
        """x `[rows, hidden]`, experts `[rows, k]` -> `[rows, k, hidden]`."""
        rows, k = experts.shape
        sort = experts.size >= SORT_PAIRS
        x = mx.expand_dims(x, (-2, -3))  # [rows, 1, 1, hidden]: one matrix row per pair
        if sort:
            flat = experts.flatten()
            order = mx.argsort(flat)
            x, experts = x.flatten(0, -3)[order // k], flat[order]
        h = self._act(self.gate_proj(x, experts, sort), self.up_proj(x, experts, sort))
        out = self.down_proj(h, experts, sort)
        if sort:
            out = out[mx.argsort(order)].reshape(rows, k, 1, -1)
        return out.squeeze(-2)

    def mix(self, x: mx.array, weights: mx.array, experts: mx.array) -> mx.array:
        """Each row's chosen experts' outputs, weighted and summed: `[rows, hidden]`."""
        if (self.dispatch or ("grouped" if on_cpu() else "gather")) == "grouped":
            return self.grouped(x, experts, weights)
        y = self(x, experts)
        return (y * weights[..., None].astype(y.dtype)).sum(axis=-2)

    def grouped(self, x: mx.array, experts: mx.array, weights: mx.array) -> mx.array:
        """The weighted sum over each row's experts, one product per chosen expert over the
        rows that chose it (evaluates on the host)."""
        k = experts.shape[1]
        flat = np.asarray(experts).reshape(-1)
        order = np.argsort(flat, kind="stable")
        starts = np.flatnonzero(np.diff(flat[order], prepend=-1))
        x_host = np.asarray(x.astype(mx.float32))
        pair_weights = np.asarray(weights.astype(mx.float32)).reshape(-1)
        out = np.zeros_like(x_host)
        for pairs in np.split(order, starts[1:]):
            e, rows = int(flat[pairs[0]]), pairs // k
            xe = x_host[rows]
            gate, up = self.gate_proj.expert(xe, e), self.up_proj.expert(xe, e)
            h = np.asarray(self._act(mx.array(gate), mx.array(up)))
            np.add.at(out, rows, self.down_proj.expert(h, e) * pair_weights[pairs, None])
        return mx.array(out).astype(x.dtype)


class CorrectedGate(nn.Module):
    """GLM's router weights plus the bias its expert choice (not the weights) adds."""

    def __init__(self, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.weight = mx.zeros((num_experts, hidden))
        self.e_score_correction_bias = mx.zeros((num_experts,))

    def __call__(self, x: mx.array) -> mx.array:
        return x.astype(mx.float32) @ self.weight.astype(mx.float32).T


def route(logits: mx.array, moe: MoeConfig,
          correction: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """(weights `[rows, k]` float32, expert ids `[rows, k]`) from router logits."""
    logits = logits.astype(mx.float32)
    if moe.scoring == "softmax":
        scores = mx.softmax(logits, axis=-1, precise=True)
    else:
        scores = mx.sigmoid(logits)
    choice = scores if correction is None else scores + correction.astype(mx.float32)
    if moe.num_groups > 1:
        choice = _best_groups_only(choice, moe)
    k = moe.experts_per_token
    experts = mx.argpartition(-choice, kth=k - 1, axis=-1)[..., :k]
    weights = mx.take_along_axis(scores, experts, axis=-1)
    if moe.normalize_top_k:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
    if moe.routed_scaling_factor != 1.0:
        weights = weights * moe.routed_scaling_factor
    return weights, experts.astype(mx.uint32)


def _best_groups_only(choice: mx.array, moe: MoeConfig) -> mx.array:
    """`choice` with experts outside each row's best groups (by their top-2 sum) at -inf."""
    rows = choice.shape[0]
    grouped = choice.reshape(rows, moe.num_groups, -1)
    top2 = mx.topk(grouped, min(2, grouped.shape[-1]), axis=-1).sum(axis=-1)
    drop = moe.num_groups - moe.groups_per_token
    worst = mx.argpartition(top2, kth=drop - 1, axis=-1)[:, :drop]
    mask = mx.zeros_like(top2).at[mx.arange(rows)[:, None], worst].add(1.0) > 0
    grouped = mx.where(mask[..., None], -mx.inf, grouped)
    return grouped.reshape(rows, -1)


class SparseMoeBlock(nn.Module):
    """Router + experts (+ the shared expert GLM adds to every token)."""

    def __init__(self, hidden: int, moe: MoeConfig, activation: Activation,
                 gate: nn.Module, shared: nn.Module | None = None) -> None:
        super().__init__()
        self.gate = gate
        self.switch_mlp = SwitchGLU(hidden, moe.expert_intermediate_size, moe.num_experts,
                                    activation)
        if shared is not None:
            self.shared_experts = shared
        self._moe = moe

    def __call__(self, x: mx.array) -> mx.array:
        correction = self.gate.get("e_score_correction_bias")
        weights, experts = route(self.gate(x), self._moe, correction)
        out = self.switch_mlp.mix(x, weights, experts)
        return out if "shared_experts" not in self else out + self.shared_experts(x)


def set_dispatch(model: nn.Module, dispatch: Dispatch | None) -> int:
    """Run every set of experts in `model` with `dispatch`; returns how many there are."""
    experts = [m for _, m in model.named_modules() if isinstance(m, SwitchGLU)]
    for glu in experts:
        glu.dispatch = dispatch
    return len(experts)
