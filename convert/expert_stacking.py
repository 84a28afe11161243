"""Hugging Face MoE checkpoints store one tensor per expert (`...experts.7.gate_proj.weight`);
the layout here stacks them into one `[experts, out, in]` tensor per projection
(`...switch_mlp.gate_proj.weight`), as mlx-lm does."""

from __future__ import annotations

import re
from collections.abc import Iterator

import mlx.core as mx

from metal_engine.model_config import ModelConfig

_PER_EXPERT = re.compile(r"^(?P<block>.+)\.experts\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$")
# Mixtral's projection names -> the stacked layout's.
_PROJECTIONS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _stacked_name(name: str) -> tuple[str, int] | None:
    """(stacked tensor name, expert index) of a per-expert tensor name, else None."""
    match = _PER_EXPERT.match(name)
    if match is None:
        return None
    proj = _PROJECTIONS.get(match["proj"], match["proj"])
    return f"{match['block']}.switch_mlp.{proj}.weight", int(match["expert"])


def stacked_shapes(config: ModelConfig,
                   shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """`shapes` with each complete set of per-expert tensors replaced by its stack. A set
    missing experts, or whose shapes differ, is an error naming it."""
    if config.moe is None:
        return shapes
    stacked: dict[str, tuple[int, ...]] = {}
    experts: dict[str, dict[int, tuple[int, ...]]] = {}
    for name, shape in shapes.items():
        target = _stacked_name(name)
        if target is None:
            stacked[name] = shape
        else:
            experts.setdefault(target[0], {})[target[1]] = shape
    count = config.moe.num_experts
    for name, by_expert in experts.items():
        missing = sorted(set(range(count)) - set(by_expert))
        if missing or len(by_expert) != count:
            raise ValueError(f"{name}: the checkpoint holds experts {sorted(by_expert)[:4]}..., "
                             f"the config says {count} (missing {missing[:4]})")
        if len(set(by_expert.values())) != 1:
            raise ValueError(f"{name}: the experts' tensors differ in shape")
        stacked[name] = (count, *by_expert[0])
    return stacked


def stack_experts(config: ModelConfig,
                  tensors: Iterator[tuple[str, mx.array]]) -> Iterator[tuple[str, mx.array]]:
    """The tensor stream with per-expert tensors held until their set is complete, then yielded
    stacked; everything else passes straight through."""
    if config.moe is None:
        yield from tensors
        return
    pending: dict[str, dict[int, mx.array]] = {}
    for name, tensor in tensors:
        target = _stacked_name(name)
        if target is None:
            yield name, tensor
            continue
        group = pending.setdefault(target[0], {})
        group[target[1]] = tensor
        if len(group) == config.moe.num_experts:
            del pending[target[0]]
            yield target[0], mx.stack([mx.array(group[e]) for e in range(len(group))])
