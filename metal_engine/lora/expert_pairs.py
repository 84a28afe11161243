"""A MoE adapter's pairs on the experts, as one stacked pair per projection.

The experts here are stacked (`...switch_mlp.{gate,up,down}_proj`, weight `[experts, out,
in]`); an adapter's pair there is A `[experts, r, in]`, B `[experts, out, r]`. mlx-lm saves
them so. PEFT saves them in one of two layouts, by how transformers held the experts:

    per expert   ...experts.<e>.gate_proj.lora_A.weight  [r, in]      (Mixtral's w1/w3/w2 too)
    fused        ...experts[.base_layer].lora_A.weight    [r * experts, in], expert-major rows
                 ...experts[.base_layer].lora_B.weight    [out, r * experts], rank-major columns
                 (`target_parameters`: `gate_up_proj` [experts, 2 * inner, hidden], gate rows
                 first, and `down_proj` [experts, hidden, inner])

Both files name two parameters of one fused module alike, so which pair is `gate_up_proj` is
read from the shapes: its outputs are twice `down_proj`'s inputs.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from metal_engine.loading.weights import stacked_expert_name

Pair = tuple[np.ndarray, np.ndarray]  # (A, scale * B)
FUSED_PARAMETERS = ("gate_up_proj", "down_proj")


def stacked_per_expert(name: str, pairs: dict[str, Pair]) -> dict[str, Pair]:
    """`pairs` with each projection's per-expert pairs as one stacked pair (zeros for the
    experts the adapter leaves alone)."""
    out: dict[str, Pair] = {}
    sets: dict[str, dict[int, Pair]] = {}
    for module, pair in pairs.items():
        stacked = stacked_expert_name(f"{module}.weight")
        if stacked is None:
            out[module] = pair
        else:
            sets.setdefault(stacked[0].removesuffix(".weight"), {})[stacked[1]] = pair
    for module, by_expert in sets.items():
        shapes = {(a.shape, b.shape) for a, b in by_expert.values()}
        if len(shapes) != 1:
            raise ValueError(f"adapter {name!r}: the experts' pairs of {module} differ in shape")
        (a_shape, b_shape), count = shapes.pop(), max(by_expert) + 1
        a, b = np.zeros((count, *a_shape), np.float32), np.zeros((count, *b_shape), np.float32)
        for expert, (expert_a, expert_b) in by_expert.items():
            a[expert], b[expert] = expert_a, expert_b
        out[module] = (a, b)
    return out


def fused_expert_pairs(name: str, module: str, found: list[Pair], parameters: list[str],
                       rank_and_scale: Callable[[str], tuple[int, float]]) -> dict[str, Pair]:
    """PEFT's (unscaled) pairs on the fused experts `module` as the stacked projections'
    pairs; `rank_and_scale` of a parameter's name (`...experts.gate_up_proj`)."""
    targeted = {p.rsplit(".", 1)[-1] for p in parameters}
    if not targeted <= set(FUSED_PARAMETERS):
        raise ValueError(f"adapter {name!r} targets the parameters {sorted(targeted)} of "
                         f"{module}: only {', '.join(FUSED_PARAMETERS)} of fused experts are "
                         "served")
    kinds = _kinds(found, sorted(targeted))
    if kinds is None:
        raise ValueError(f"adapter {name!r}: cannot tell which of {module}'s {len(found)} "
                         f"pairs adapt which of {sorted(targeted)}")
    block = module.removesuffix(".experts") + ".switch_mlp"
    pairs = {}
    for kind, (a, b) in zip(kinds, found, strict=True):
        rank, scale = rank_and_scale(f"{module}.{kind}")
        a, b = _per_expert(name, f"{module}.{kind}", a, b * scale, rank)
        if kind == "down_proj":
            pairs[f"{block}.down_proj"] = (a, b)
        else:
            gate, up = np.split(b, 2, axis=1)
            pairs[f"{block}.gate_proj"], pairs[f"{block}.up_proj"] = (a, gate), (a, up)
    return pairs


def _kinds(found: list[Pair], targeted: list[str]) -> list[str] | None:
    """Which parameter each pair adapts; None if the shapes do not say."""
    if len(found) == 1 and len(targeted) == 1:
        return targeted
    if len(found) != 2 or len(targeted) != 2:
        return None
    (a0, b0), (a1, b1) = found
    first_gate_up = b0.shape[0] == 2 * a1.shape[1] and b1.shape[0] == a0.shape[1]
    second_gate_up = b1.shape[0] == 2 * a0.shape[1] and b0.shape[0] == a1.shape[1]
    if first_gate_up == second_gate_up:
        return None
    return ["gate_up_proj", "down_proj"] if first_gate_up else ["down_proj", "gate_up_proj"]


def _per_expert(name: str, module: str, a: np.ndarray, b: np.ndarray, rank: int) -> Pair:
    """A `[r * experts, in]`, B `[out, r * experts]` -> A `[experts, r, in]`, B `[experts,
    out, r]`."""
    experts, remainder = divmod(a.shape[0], rank)
    if remainder or b.shape[1] != a.shape[0]:
        raise ValueError(f"adapter {name!r}: {module}'s A {a.shape} and B {b.shape} are not "
                         f"rank {rank} per expert")
    return (a.reshape(experts, rank, -1),
            b.reshape(b.shape[0], rank, experts).transpose(2, 0, 1))
