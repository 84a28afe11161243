"""Mixture-of-experts layers for the packed `[total_q, hidden]` rows of a step (parameters and
children read as items per call: models/layers.py says why).

Expert weights are stored stacked, `[experts, out, in]` under `switch_mlp.*` (mlx-lm's layout,
so its quantized checkpoints load as they are). Two ways to run the chosen experts:

- `gather`: gathered matmuls (`mx.gather_mm` / `mx.gather_qmm`), one product per (token,
  expert) pair, the pairs sorted by expert once there are enough of them that reading each
  expert's weights once pays for the sort. No host sync; the way on Metal.
- `grouped`: one product per expert that any row chose, over those rows, on the host: the
  CPU backend's way (its ops' `grouped_experts`).

The backend's `expert_dispatch` picks one unless `dispatch` is set.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Literal

import mlx.core as mx
import mlx.nn as nn

from metal_engine.models.moe_config import MoeConfig
from metal_engine.models.ops_user import OpsUser

# (token, expert) pairs from which sorting by expert beats gathering in token order.
SORT_PAIRS = 64
# (gate, up) -> hidden: a gated activation's name (the ops compute it) or a function
Activation = str | Callable[[mx.array, mx.array], mx.array]
Dispatch = Literal["gather", "grouped"]


class SwitchLinear(nn.Module):
    """One linear layer per expert: `weight [experts, out, in]`, optional `bias [experts, out]`."""

    lora = None  # its metal_engine.lora.slots.LoraWeights, once an adapter targets it

    def __init__(self, in_dims: int, out_dims: int, num_experts: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = mx.zeros((num_experts, out_dims, in_dims))
        if bias:
            self.bias = mx.zeros((num_experts, out_dims))

    def __call__(self, x: mx.array, experts: mx.array, sorted_experts: bool) -> mx.array:
        """x `[..., 1, in]`, experts `[...]` -> `[..., 1, out]`, row i through expert i."""
        out = mx.gather_mm(x, self["weight"].swapaxes(-1, -2), rhs_indices=experts,
                           sorted_indices=sorted_experts)  # fmt: skip
        return out if "bias" not in self else out + mx.expand_dims(self["bias"][experts], -2)

    def to_quantized(self, group_size: int = 64, bits: int = 4, mode: str = "affine",
                     **_: object) -> QuantizedSwitchLinear:
        return QuantizedSwitchLinear(self, group_size, bits, mode)


class QuantizedSwitchLinear(nn.Module):
    """SwitchLinear with each expert's weight quantized as `mx.quantize` packs it."""

    lora = None

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
        out = mx.gather_qmm(x, self["weight"], self["scales"], self.get("biases"),
                            rhs_indices=experts, transpose=True, group_size=self.group_size,
                            bits=self.bits, mode=self.mode,
                            sorted_indices=sorted_experts)  # fmt: skip
        return out if "bias" not in self else out + mx.expand_dims(self["bias"][experts], -2)


class SwitchGLU(nn.Module, OpsUser):
    """The experts: `down(act(gate(x), up(x)))`, each through its own weights. `dispatch`:
    how they run (see the module docstring); None: as the backend says."""

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
        lora = self._active_lora()
        # Each (row, expert) pair's index into the projections' LoRA stacks.
        adapted = None if lora is None else lora.expert_index(experts)  # [rows, k]
        sort = experts.size >= SORT_PAIRS
        x = mx.expand_dims(x, (-2, -3))  # [rows, 1, 1, hidden]: one matrix row per pair
        if sort:
            flat = experts.flatten()
            # By (expert, adapter) where adapters apply: still sorted by expert.
            order = mx.argsort(flat if adapted is None else adapted.flatten())
            x, experts = x.flatten(0, -3)[order // k], flat[order]
            adapted = None if adapted is None else adapted.flatten()[order]
        project = partial(self._project, experts=experts, adapted=adapted, sort=sort)
        h = self.activate(project(self["gate_proj"], x), project(self["up_proj"], x))
        out = project(self["down_proj"], h)
        if sort:
            out = out[mx.argsort(order)].reshape(rows, k, 1, -1)
        return out.squeeze(-2)

    def _active_lora(self):
        """A projection's LoRA stacks (metal_engine.lora.slots.LoraWeights) in a step with
        adapter rows, where an adapter targets these experts; else None."""
        for linear in (self.gate_proj, self.up_proj, self.down_proj):
            if linear.lora is not None and linear.lora.active:
                return linear.lora
        return None

    def _project(self, linear: nn.Module, x: mx.array, experts: mx.array,
                 adapted: mx.array | None, sort: bool) -> mx.array:
        y = linear(x, experts, sort)
        if adapted is None or linear.lora is None:
            return y
        return y + self.ops.low_rank(x, linear.lora.a, linear.lora.b, adapted,
                                     sort).astype(y.dtype)

    def activate(self, gate: mx.array, up: mx.array) -> mx.array:
        act = self._act
        return self.ops.activation(act, gate, up) if isinstance(act, str) else act(gate, up)

    def mix(self, x: mx.array, weights: mx.array, experts: mx.array) -> mx.array:
        """Each row's chosen experts' outputs, weighted and summed: `[rows, hidden]`."""
        grouped = (self.dispatch or self.ops.expert_dispatch) == "grouped"
        if grouped and self._active_lora() is None:  # adapters run gathered
            return self.ops.grouped_experts(self, x, experts, weights)
        y = self(x, experts)
        return (y * weights[..., None].astype(y.dtype)).sum(axis=-2)


class CorrectedGate(nn.Module):
    """A router's weights plus the bias its expert choice (not the weights) adds. GLM and
    DeepSeek take the logits in float32, Laguna in the model's dtype (`float32_logits`)."""

    def __init__(self, hidden: int, num_experts: int, float32_logits: bool = True) -> None:
        super().__init__()
        self.weight = mx.zeros((num_experts, hidden))
        self.e_score_correction_bias = mx.zeros((num_experts,))
        self._float32_logits = float32_logits

    def __call__(self, x: mx.array) -> mx.array:
        if not self._float32_logits:
            return x @ self.weight.T
        return x.astype(mx.float32) @ self.weight.astype(mx.float32).T


def route(logits: mx.array, moe: MoeConfig,
          correction: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """(weights `[rows, k]` float32, expert ids `[rows, k]`) from router logits."""
    logits = logits.astype(mx.float32)
    cap = moe.router_logit_softcapping
    if cap is not None:
        logits = mx.tanh(logits / cap) * cap
    if moe.scoring == "softmax":
        scores = mx.softmax(logits, axis=-1, precise=True)
    else:
        scores = mx.sigmoid(logits)
    choice = scores if correction is None else scores + correction.astype(mx.float32)
    if moe.num_groups > 1:
        choice = _best_groups_only(choice, moe)
    k = moe.experts_per_token
    experts = mx.argpartition(choice, kth=-k, axis=-1)[..., -k:]  # the k largest, any order
    weights = mx.take_along_axis(scores, experts, axis=-1)
    if moe.normalize_top_k:
        weights = _normalized(weights, weights.sum(axis=-1, keepdims=True))
    if moe.routed_scaling_factor != 1.0:
        weights = weights * moe.routed_scaling_factor
    return weights, experts.astype(mx.uint32)


@partial(mx.compile, shapeless=True)
def _normalized(weights: mx.array, total: mx.array) -> mx.array:
    return weights / (total + 1e-20)


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
    """Router + experts (+ the shared expert GLM adds to every token, under `shared_name`).
    The correction bias of the expert choice is the router's (`CorrectedGate`) or, with
    `correction_on_block`, the block's own (MiniMax M2's)."""

    def __init__(self, hidden: int, moe: MoeConfig, activation: Activation,
                 gate: nn.Module, shared: nn.Module | None = None,
                 correction_on_block: bool = False, shared_name: str = "shared_experts") -> None:
        super().__init__()
        self.gate = gate
        self.switch_mlp = SwitchGLU(hidden, moe.expert_intermediate_size, moe.num_experts,
                                    activation)
        if shared is not None:
            setattr(self, shared_name, shared)
        if correction_on_block:
            self.e_score_correction_bias = mx.zeros((moe.num_experts,))
        self._moe, self._shared_name = moe, shared_name

    def __call__(self, x: mx.array) -> mx.array:
        gate = self["gate"]
        correction = self.get("e_score_correction_bias", gate.get("e_score_correction_bias"))
        weights, experts = route(gate(x), self._moe, correction)
        out = self["switch_mlp"].mix(x, weights, experts)
        shared = self.get(self._shared_name)
        return out if shared is None else out + shared(x)


def set_dispatch(model: nn.Module, dispatch: Dispatch | None) -> int:
    """Run every set of experts in `model` with `dispatch`; returns how many there are."""
    experts = [m for _, m in model.named_modules() if isinstance(m, SwitchGLU)]
    for glu in experts:
        glu.dispatch = dispatch
    return len(experts)
