"""Hugging Face MoE checkpoints store one tensor per expert (`...experts.7.gate_proj.weight`);
the layout here stacks them into one `[experts, out, in]` tensor per projection
(`...switch_mlp.gate_proj.weight`), as mlx-lm does.

GPT-OSS's checkpoints are stacked already but fused and `[in, out]`: `experts.gate_up_proj
[experts, hidden, 2 * inner]` with gate and up interleaved (even and odd columns), and
`experts.down_proj [experts, inner, hidden]`, biases beside them; they are split and
transposed into `experts.{gate,up,down}_proj.{weight,bias}`. Gemma 4's are fused but `[out,
in]`: `experts.gate_up_proj [experts, 2 * inner, hidden]` (gate rows first) and
`experts.down_proj [experts, hidden, inner]`. Qwen3.5-MoE's published checkpoints are fused as
Gemma 4's (transformers saves them one tensor per expert), Mistral 4's too (and transformers
saves them so); those become `switch_mlp.*`. Qwen3-VL-MoE's published checkpoints are fused
`[experts, in, out]`, gate columns first, but transformers saves them `[experts, out, in]`
(it reads either, by shape): each tensor's shape tells here too."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, replace

import mlx.core as mx

from metal_engine.loading.model_config import ModelConfig
from metal_engine.loading.weights import expert_sets, stacked_expert_name


@dataclass(frozen=True)
class FusedExperts:
    """How a family stores its stacked experts: `[experts, in, out]` (`transposed`) or
    `[experts, out, in]`, or either (None: each tensor's shape tells, against `hidden_size`);
    gate and up rows alternating (`interleaved`) or gate's first."""

    transposed: bool | None
    interleaved: bool
    module: str = "experts"  # where the split projections go, beside `experts`' block
    hidden_size: int = 0  # the model's, for `transposed=None`

    def is_transposed(self, kind: str, shape: tuple[int, ...]) -> bool:
        if self.transposed is not None:
            return self.transposed
        # `[experts, out, in]` has the hidden size last in gate_up, in the middle in down;
        # transformers reads a tensor that fits both ways (square) so too.
        return shape[2 if kind == "gate_up_proj" else 1] != self.hidden_size

    def split_shapes(self, name: str,
                     shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]] | None:
        """The (name, shape) pairs the fused tensor `name` becomes; None if it is not one."""
        parts = _fused_parts(name)
        if parts is None:
            return None
        block, kind, bias = parts
        prefix = f"{block}.{self.module}"
        if bias:
            experts, width = shape
            if kind == "down_proj":
                return [(f"{prefix}.down_proj.bias", shape)]
            return [(f"{prefix}.{p}.bias", (experts, width // 2)) for p in _GATE_UP]
        experts, rows, cols = shape
        out, inner = (cols, rows) if self.is_transposed(kind, shape) else (rows, cols)
        if kind == "down_proj":
            return [(f"{prefix}.down_proj.weight", (experts, out, inner))]
        return [(f"{prefix}.{p}.weight", (experts, out // 2, inner)) for p in _GATE_UP]

    def split(self, name: str, tensor: mx.array) -> list[tuple[str, mx.array]]:
        names = [n for n, _ in self.split_shapes(name, tuple(tensor.shape))]
        block, kind, bias = _fused_parts(name)
        tensor = mx.array(tensor)
        if not bias and self.is_transposed(kind, tuple(tensor.shape)):
            tensor = tensor.swapaxes(-1, -2)  # now [experts, out, in]
        if kind == "down_proj":
            return [(names[0], tensor)]
        if self.interleaved:
            halves = (tensor[:, 0::2], tensor[:, 1::2])
        else:
            halves = tuple(mx.split(tensor, 2, axis=1))
        return list(zip(names, halves, strict=True))


_GATE_UP = ("gate_proj", "up_proj")
FUSED_LAYOUTS = {
    "gpt_oss": FusedExperts(transposed=True, interleaved=True),
    "gemma4_text": FusedExperts(transposed=False, interleaved=False),
    "qwen3_5_moe_text": FusedExperts(transposed=False, interleaved=False, module="switch_mlp"),
    "mistral4": FusedExperts(transposed=False, interleaved=False, module="switch_mlp"),
    "qwen3_vl_moe_text": FusedExperts(transposed=None, interleaved=False, module="switch_mlp"),
}


def fused_layout(config: ModelConfig) -> FusedExperts | None:
    """How `config`'s family fuses its stacked experts (None: one tensor per expert)."""
    fused = FUSED_LAYOUTS.get(config.model_type)
    return None if fused is None else replace(fused, hidden_size=config.hidden_size)


def _fused_parts(name: str) -> tuple[str, str, bool] | None:
    """(block, "gate_up_proj" or "down_proj", is a bias) of a fused expert tensor name."""
    match = re.fullmatch(r"(.+)\.experts\.(gate_up_proj|down_proj)(_bias)?", name)
    return None if match is None else (match[1], match[2], match[3] is not None)


def stacked_shapes(config: ModelConfig,
                   shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """`shapes` with each fused expert tensor replaced by its parts and each complete set of
    per-expert tensors by its stack. A set missing experts, or whose shapes differ, is an
    error naming it."""
    fused = fused_layout(config)
    if fused is not None:
        shapes = {new: shape for name, old in shapes.items()
                  for new, shape in (fused.split_shapes(name, old) or [(name, old)])}
    if config.moe is None:
        return shapes
    stacked, sets = expert_sets(shapes, config.moe.num_experts)
    for name, by_expert in sets.items():
        if len(set(by_expert)) != 1:
            raise ValueError(f"{name}: the experts' tensors differ in shape")
        stacked[name] = (len(by_expert), *by_expert[0])
    return stacked


def stack_experts(config: ModelConfig,
                  tensors: Iterator[tuple[str, mx.array]]) -> Iterator[tuple[str, mx.array]]:
    """The tensor stream with fused expert tensors split, per-expert ones held until their set
    is complete, then yielded stacked; everything else passes straight through."""
    fused = fused_layout(config)
    if fused is not None:
        tensors = (part for name, tensor in tensors
                   for part in (fused.split(name, tensor) if _fused_parts(name)
                                else [(name, tensor)]))
    if config.moe is None:
        yield from tensors
        return
    pending: dict[str, dict[int, mx.array]] = {}
    for name, tensor in tensors:
        target = stacked_expert_name(name)
        if target is None:
            yield name, tensor
            continue
        group = pending.setdefault(target[0], {})
        group[target[1]] = tensor
        if len(group) == config.moe.num_experts:
            del pending[target[0]]
            yield target[0], mx.stack([mx.array(group[e]) for e in range(len(group))])
