"""Tensor parallelism's weight split: each rank keeps a share of every layer's heads and inner
width, and the layers' outputs are summed across ranks.

    attention      KV heads split in contiguous runs (each with its query heads); q/k/v rows
                   and o_proj columns follow, o_proj's output is summed across ranks
    MLP            gate/up rows and down columns split by the inner width; down's output summed
    experts        every expert's inner width split the same way; the block's output summed
                   (the router and a shared expert's gate stay whole on every rank)
    Gated DeltaNet key heads split (each with its value heads); conv channels, the projections
                   and the per-head parameters follow; out_proj's output summed

Shares may be uneven (3 KV heads over 2 ranks: 2 and 1), so any head count at least the rank
count splits. Embeddings, norms and the LM head stay whole. A bias on a summed output is kept
by rank 0 alone. Slices are copied out, so a rank holds only its share once the model is
evaluated (`metal_engine.loading.weights.load_model(shard=...)` shards before that).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import mlx.core as mx
import mlx.nn as nn

from metal_engine.loading.model_config import ModelConfig
from metal_engine.models.decoder import CausalLM
from metal_engine.models.gated_delta import GatedDeltaNet
from metal_engine.models.layers import MLP, Attention
from metal_engine.models.moe import QuantizedSwitchLinear, SwitchGLU, SwitchLinear
from metal_engine.models.qwen3_5 import GatedAttention

Reduce = Callable[[mx.array], mx.array]


def share(count: int, rank: int, size: int, what: str = "heads") -> range:
    """Rank `rank`'s contiguous share of `count` units; earlier ranks take the remainder."""
    if count < size:
        raise ValueError(f"{count} {what} cannot be split over {size} ranks")
    base, extra = divmod(count, size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


class SummedOutput(nn.Module):
    """A module whose output is this rank's part of a sum over ranks: `reduce` adds them."""

    def __init__(self, inner: nn.Module, reduce: Reduce) -> None:
        super().__init__()
        self.inner = inner
        self._reduce = reduce

    def __call__(self, *args, **kwargs):
        return self._reduce(self.inner(*args, **kwargs))


@dataclass(frozen=True)
class RankShare:
    rank: int
    size: int
    reduce: Reduce  # the sum over ranks (mx.distributed.all_sum over the group)


def rank_config(cfg: ModelConfig, part: RankShare) -> ModelConfig:
    """`cfg` with the heads rank `part.rank` holds: what sizes its KV pools and state slots."""
    kv_heads = share(cfg.num_key_value_heads, part.rank, part.size)
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    linear = cfg.linear_attention
    if linear is not None:
        key_heads = len(share(linear.num_key_heads, part.rank, part.size))
        ratio = linear.num_value_heads // linear.num_key_heads
        linear = replace(linear, num_key_heads=key_heads, num_value_heads=key_heads * ratio)
    return replace(cfg, num_attention_heads=len(kv_heads) * group,
                   num_key_value_heads=len(kv_heads), linear_attention=linear)


def shard_model(model: CausalLM, part: RankShare) -> None:
    """Keep `part.rank`'s share of `model`'s weights, in place."""
    cfg = model.config
    refused = [type(m).__name__ for m in _layer_parts(model) if not _shardable(m)]
    if refused:
        raise ValueError(
            f"tensor parallelism does not split {cfg.model_type}'s {refused[0]} layers yet: "
            "serve it with --tensor-parallel-size 1"
        )
    kv_heads = share(cfg.num_key_value_heads, part.rank, part.size)
    heads = _query_heads(kv_heads, cfg.num_attention_heads // cfg.num_key_value_heads)
    for layer in model.model.layers:
        if "self_attn" in layer:
            _shard_attention(layer, heads, kv_heads, part)
        if "linear_attn" in layer:
            layer.linear_attn.out_proj = _shard_delta_net(layer.linear_attn, part)
        feed = "block_sparse_moe" if "block_sparse_moe" in layer else "mlp"
        layer[feed] = _shard_feed_forward(layer[feed], part)


def _layer_parts(model: CausalLM) -> list[nn.Module]:
    parts = []
    for layer in model.model.layers:
        for name in ("self_attn", "linear_attn", "mlp", "block_sparse_moe"):
            if name in layer:
                parts.append(layer[name])
    return parts


def _shardable(module: nn.Module) -> bool:
    # Exactly these classes: a subclass may hold what the split does not know (MiniMax M2's
    # norms across all heads, an output gate's rows).
    if type(module) in (Attention, GatedAttention, GatedDeltaNet, MLP):
        return True
    # An experts block: its experts and any dense MLP inside are split, the rest stays whole.
    children = module.children().values()
    return any(isinstance(c, SwitchGLU) for c in children) and all(
        isinstance(c, (SwitchGLU, MLP, nn.Linear, nn.QuantizedLinear))
        or type(c).__name__ == "CorrectedGate" for c in children)


def _query_heads(kv_heads: range, group: int) -> range:
    return range(kv_heads.start * group, kv_heads.stop * group)


def _shard_attention(layer: nn.Module, heads: range, kv_heads: range, part: RankShare) -> None:
    attn = layer.self_attn
    dim = attn.head_dim
    q_width = 2 * dim if isinstance(attn, GatedAttention) else dim  # q and its gate, per head
    q_rows = _units(heads, q_width)
    kv_rows = _units(kv_heads, dim)
    if "qkv_proj" in attn:
        q_out, kv_out = attn.num_heads * dim, attn.num_kv_heads * dim
        attn.qkv_proj = take_rows(attn.qkv_proj, [
            *q_rows, *_offset(kv_rows, q_out), *_offset(kv_rows, q_out + kv_out)])
    else:
        attn.q_proj = take_rows(attn.q_proj, q_rows)
        attn.k_proj = take_rows(attn.k_proj, kv_rows)
        attn.v_proj = take_rows(attn.v_proj, kv_rows)
    if "sinks" in attn:
        attn.sinks = mx.contiguous(attn.sinks[heads.start:heads.stop])
    attn.o_proj = SummedOutput(take_columns(attn.o_proj, heads.start * dim, heads.stop * dim,
                                            part.rank), part.reduce)
    attn.num_heads, attn.num_kv_heads = len(heads), len(kv_heads)


def _shard_delta_net(net: GatedDeltaNet, part: RankShare) -> SummedOutput:
    """Split by key heads, each with its `Hv / Hk` value heads; returns the summed out_proj."""
    cfg = net.cfg
    key_heads = share(cfg.num_key_heads, part.rank, part.size)
    ratio = cfg.num_value_heads // cfg.num_key_heads
    value_heads = range(key_heads.start * ratio, key_heads.stop * ratio)
    keys = _units(key_heads, cfg.key_head_dim)
    values = _units(value_heads, cfg.value_head_dim)
    channels = [*keys, *_offset(keys, cfg.key_dim), *_offset(values, 2 * cfg.key_dim)]
    net.in_proj_qkv = take_rows(net.in_proj_qkv, channels)
    net.conv1d.weight = _rows(net.conv1d.weight, channels)
    net.in_proj_z = take_rows(net.in_proj_z, values)
    heads = [(value_heads.start, value_heads.stop)]
    net.in_proj_b = take_rows(net.in_proj_b, heads)
    net.in_proj_a = take_rows(net.in_proj_a, heads)
    net.dt_bias = _rows(net.dt_bias, heads)
    net.A_log = _rows(net.A_log, heads)
    net.cfg = replace(cfg, num_key_heads=len(key_heads), num_value_heads=len(value_heads))
    start, stop = values[0]
    return SummedOutput(take_columns(net.out_proj, start, stop, part.rank), part.reduce)


def _shard_feed_forward(block: nn.Module, part: RankShare) -> SummedOutput:
    """A dense MLP or an experts block, split by inner width, its output summed over ranks."""
    mlps = [block] if isinstance(block, MLP) else [
        c for c in block.children().values() if isinstance(c, (MLP, SwitchGLU))]
    for mlp in mlps:
        if isinstance(mlp, SwitchGLU):
            _shard_experts(mlp, part)
        else:
            _shard_mlp(mlp, part)
    return SummedOutput(block, part.reduce)


def _shard_mlp(mlp: MLP, part: RankShare) -> None:
    inner = mlp.down_proj.weight.shape[-1] * _pack(mlp.down_proj)
    cols = share(inner, part.rank, part.size)
    rows = [(cols.start, cols.stop)]
    if "gate_up_proj" in mlp:
        mlp.gate_up_proj = take_rows(mlp.gate_up_proj, [*rows, *_offset(rows, inner)])
    else:
        mlp.gate_proj = take_rows(mlp.gate_proj, rows)
        mlp.up_proj = take_rows(mlp.up_proj, rows)
    mlp.down_proj = take_columns(mlp.down_proj, cols.start, cols.stop, part.rank)


def _shard_experts(glu: SwitchGLU, part: RankShare) -> None:
    inner = glu.gate_proj.weight.shape[1]
    cols = share(inner, part.rank, part.size)
    for proj in (glu.gate_proj, glu.up_proj):
        for name in ("weight", "scales", "biases", "bias"):
            if name in proj:
                proj[name] = mx.contiguous(proj[name][:, cols.start:cols.stop])
    take_columns(glu.down_proj, cols.start, cols.stop, part.rank)


def _units(units: range, width: int) -> list[tuple[int, int]]:
    return [(units.start * width, units.stop * width)]


def _offset(rows: Sequence[tuple[int, int]], by: int) -> list[tuple[int, int]]:
    return [(start + by, stop + by) for start, stop in rows]


def _rows(array: mx.array, rows: Sequence[tuple[int, int]]) -> mx.array:
    parts = [array[start:stop] for start, stop in rows]
    return mx.contiguous(parts[0] if len(parts) == 1 else mx.concatenate(parts))


def take_rows(linear: nn.Module, rows: Sequence[tuple[int, int]]) -> nn.Module:
    """`linear` keeping only the output rows in `rows` ((start, stop) runs, in order)."""
    for name in ("weight", "scales", "biases", "bias"):
        if name in linear:
            linear[name] = _rows(linear[name], rows)
    return linear


def take_columns(linear: nn.Module, start: int, stop: int, rank: int) -> nn.Module:
    """`linear` (or a stack of experts' linears) over input features `start:stop` only (its
    output is then a part of a sum: only rank 0 keeps the bias)."""
    pack = _pack(linear)
    start, stop = _packed(start, stop, pack, linear)
    linear.weight = mx.contiguous(linear.weight[..., start // pack:stop // pack])
    group = getattr(linear, "group_size", None)
    for name in ("scales", "biases"):
        if name in linear:
            linear[name] = mx.contiguous(linear[name][..., start // group:stop // group])
    if "bias" in linear and rank:
        linear.bias = mx.zeros_like(linear.bias)
    return linear


def _pack(linear: nn.Module) -> int:
    """Input features per stored weight element (a quantized layer packs them in uint32s)."""
    if isinstance(linear, (nn.QuantizedLinear, QuantizedSwitchLinear)):
        return 32 // linear.bits
    if isinstance(linear, (nn.Linear, SwitchLinear)):
        return 1
    raise ValueError(f"tensor parallelism cannot split a {type(linear).__name__}")


def _packed(start: int, stop: int, pack: int, linear: nn.Module) -> tuple[int, int]:
    """The column range, checked against the quantized layout it must not cut through."""
    unit = max(pack, getattr(linear, "group_size", 1) or 1)
    if start % unit or stop % unit:
        raise ValueError(
            f"a rank's share of input features {start}:{stop} cuts through the quantization "
            f"groups of {unit}: serve this model with another --tensor-parallel-size"
        )
    return start, stop
