"""Gated DeltaNet, the linear-attention layer of Qwen3.5 / Qwen3-Next, over packed rows.

A request's whole history lives in two states the caller passes in and gets back: the conv
state (its last `kernel_size - 1` conv inputs, `[num_seqs, kernel_size - 1, conv_dim]`) and
the recurrent state of the delta rule (`[num_seqs, Hv, Dk, Dv]`). Zeros start a request.
Parameter names and shapes are Hugging Face's qwen3_5 ones (`conv1d.weight [conv_dim, 1, K]`);
they and the children are read as items per call (models/layers.py says why).
"""

from __future__ import annotations

from functools import lru_cache, partial
from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from metal_engine.models.layers import FromWeight, Linear, PackedLinears
from metal_engine.models.linear_attention_config import GatedDeltaNetConfig
from metal_engine.models.ops_user import OpsUser


def _conv_indices(cu_seqlens, kernel_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices into `concat([rows, states.reshape(-1, C)])`: each row's conv window
    `[total_q, K]` (oldest first) and each request's new state `[num_seqs, K - 1]`.

    Laid out per request as its K - 1 state rows, then its rows:
        extended:  | s0 s0 s0 | r0 r0 r0 r0 r0 | s1 s1 s1 | r1 | ...
    """
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    lens, width = np.diff(cu), kernel_size - 1
    num_seqs, total = len(lens), int(cu[-1])
    row_request = np.repeat(np.arange(num_seqs), lens)
    row_at = np.arange(total) + (row_request + 1) * width
    state_at = (cu[:-1] + np.arange(num_seqs) * width)[:, None] + np.arange(width)
    extended = np.empty(total + num_seqs * width, dtype=np.int64)
    extended[row_at] = np.arange(total)
    extended[state_at] = total + np.arange(num_seqs * width).reshape(num_seqs, width)
    windows = extended[row_at[:, None] - width + np.arange(kernel_size)]
    new_state = extended[state_at + lens[:, None]]
    return windows, new_state


# Rows from which the conv takes one tap at a time: its temporaries stay `[total_q, C]`.
ONE_TAP_ROWS = 64


class ConvGathers(NamedTuple):
    windows: list[mx.array]  # [total_q, K] of every tap together, or [total_q] per tap
    new_state: mx.array  # [num_seqs, K - 1]


@lru_cache(maxsize=8)
def _conv_gathers(cu_bytes: bytes, dtype: str, kernel_size: int) -> ConvGathers:
    """A step's conv indices on the device, made once for all its linear-attention layers
    (`cu_bytes`: its `cu_seqlens` of numpy dtype `dtype`)."""
    windows, new_state = _conv_indices(np.frombuffer(cu_bytes, dtype), kernel_size)
    columns = ([windows] if len(windows) < ONE_TAP_ROWS
               else [windows[:, j] for j in range(kernel_size)])
    return ConvGathers([mx.array(c) for c in columns], mx.array(new_state))


def causal_conv1d(x: mx.array, weight: mx.array, cu_seqlens, state: mx.array,
                  silu=nn.silu) -> tuple[mx.array, mx.array]:
    """Depthwise causal conv of each request's rows `x [total_q, C]`, continuing from its
    `state [num_seqs, K - 1, C]`, then `silu`. `weight [C, 1, K]`. Returns (out, new state)."""
    return conv_with_taps(x, ConvTaps.of(weight), cu_seqlens, state, silu)


class ConvTaps(NamedTuple):
    """A conv weight `[C, 1, K]` as float32 taps: `whole [K, C]` and each tap's row `[1, C]`
    (views of it). Summed in float32, since taps rounded to bfloat16 add up to visible error."""

    whole: mx.array
    rows: list[mx.array]

    @classmethod
    def of(cls, weight: mx.array) -> ConvTaps:
        channels, kernel_size = weight.shape[0], weight.shape[-1]
        whole = weight.reshape(channels, kernel_size).T.astype(mx.float32)
        return cls(whole, mx.split(whole, kernel_size))


def conv_with_taps(x: mx.array, taps: ConvTaps, cu_seqlens, state: mx.array,
                   silu=nn.silu) -> tuple[mx.array, mx.array]:
    """`causal_conv1d` with its weight's `ConvTaps`."""
    kernel_size, channels = len(taps.rows), x.shape[-1]
    cu = np.asarray(cu_seqlens)  # as it is: a cast would copy it every layer
    gathers = _conv_gathers(cu.tobytes(), cu.dtype.str, kernel_size)
    source = mx.concatenate([x, state.astype(x.dtype).reshape(-1, channels)])
    if len(gathers.windows) == 1:  # a few rows: every tap in one gather and one sum
        out = _tapped(source[gathers.windows[0]], taps.whole).sum(axis=1)
    else:
        out = _tap_sum([source[w] for w in gathers.windows], taps.rows)
    return silu(out).astype(x.dtype), source[gathers.new_state]


@partial(mx.compile, shapeless=True)
def _tapped(values: mx.array, taps: mx.array) -> mx.array:
    return values.astype(mx.float32) * taps


@partial(mx.compile, shapeless=True)
def _tap_sum(columns: list[mx.array], taps: list[mx.array]) -> mx.array:
    """`sum_j columns[j] * taps[j]` in float32, oldest tap first: one kernel on Metal."""
    out = columns[0].astype(mx.float32) * taps[0]
    for column, tap in zip(columns[1:], taps[1:], strict=True):
        out = out + column.astype(mx.float32) * tap
    return out


class CausalConv1d(nn.Module, OpsUser):
    def __init__(self, channels: int, kernel_size: int) -> None:
        super().__init__()
        self.weight = mx.zeros((channels, 1, kernel_size))
        self._taps = FromWeight(ConvTaps.of)

    def __call__(self, x: mx.array, cu_seqlens, state: mx.array) -> tuple[mx.array, mx.array]:
        return conv_with_taps(x, self._taps(self["weight"]), cu_seqlens, state, self.ops.silu)


class GatedRMSNorm(nn.Module, OpsUser):
    """RMSNorm of each head's output, then times SiLU of the gate (norm before gate)."""

    def __init__(self, dims: int, eps: float) -> None:
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x: mx.array, gate: mx.array) -> mx.array:
        # silu(gate) * normed in the activation dtype, as mlx-lm does: one kernel on Metal
        return self.ops.activation("silu", gate, self.ops.rms_norm(x, self["weight"], self.eps))


class DeltaNetStep(NamedTuple):
    out: mx.array  # [total_q, hidden]
    conv_state: mx.array  # [num_seqs, K - 1, conv_dim]
    recurrent_state: mx.array  # [num_seqs, Hv, Dk, Dv] float32


class GatedDeltaNet(nn.Module, OpsUser):
    """Qwen3.5's linear-attention layer over packed rows, with explicit per-request states.
    Its four input projections run as one product where the backend packs them."""

    def __init__(self, cfg: GatedDeltaNetConfig) -> None:
        super().__init__()
        self.cfg = cfg
        hidden, heads = cfg.hidden_size, cfg.num_value_heads
        self.in_proj_qkv = Linear(hidden, cfg.conv_dim, bias=False)
        self.in_proj_z = Linear(hidden, cfg.value_dim, bias=False)
        self.in_proj_b = Linear(hidden, heads, bias=False)
        self.in_proj_a = Linear(hidden, heads, bias=False)
        self.conv1d = CausalConv1d(cfg.conv_dim, cfg.conv_kernel_size)
        self.dt_bias = mx.ones((heads,))
        self.A_log = mx.zeros((heads,))
        self.norm = GatedRMSNorm(cfg.value_head_dim, cfg.rms_norm_eps)
        self.out_proj = Linear(cfg.value_dim, hidden, bias=False)
        self._inputs = PackedLinears(self, "in_proj_qkv", "in_proj_z", "in_proj_b",
                                     "in_proj_a")

    def zero_states(self, num_seqs: int, dtype: mx.Dtype = mx.float32):
        """(conv state, recurrent state) of requests that have seen no rows yet."""
        cfg = self.cfg
        conv = mx.zeros((num_seqs, cfg.conv_kernel_size - 1, cfg.conv_dim), dtype=dtype)
        shape = (num_seqs, cfg.num_value_heads, cfg.key_head_dim, cfg.value_head_dim)
        return conv, mx.zeros(shape, dtype=mx.float32)

    def __call__(self, x: mx.array, cu_seqlens, conv_state: mx.array,
                 recurrent_state: mx.array) -> DeltaNetStep:
        """`x [total_q, hidden]` rows packed by `cu_seqlens`; states as `zero_states`."""
        cfg, total = self.cfg, x.shape[0]
        qkv, z, b, a = self.ops.linears(x, self._inputs)
        mixed, conv_state = self["conv1d"](qkv, cu_seqlens, conv_state)
        q, k, v = mx.split(mixed, [cfg.key_dim, 2 * cfg.key_dim], axis=-1)
        q = q.reshape(total, cfg.num_key_heads, cfg.key_head_dim)
        k = k.reshape(total, cfg.num_key_heads, cfg.key_head_dim)
        v = v.reshape(total, cfg.num_value_heads, cfg.value_head_dim)
        g, beta = _decay_and_beta(a, b, self["dt_bias"], self["A_log"])
        rule = self.ops.gated_delta_rule(q, k, v, g, beta, cu_seqlens, recurrent_state)
        z = z.reshape(total, cfg.num_value_heads, cfg.value_head_dim)
        out = self["norm"](rule.out, z).reshape(total, cfg.value_dim)
        return DeltaNetStep(self["out_proj"](out), conv_state, rule.state)


@partial(mx.compile, shapeless=True)
def _decay_and_beta(a: mx.array, b: mx.array, dt_bias: mx.array,
                    a_log: mx.array) -> tuple[mx.array, mx.array]:
    """(g, beta) float32: g = -exp(A_log) * softplus(a + dt_bias) (exp(A_log) overflows fp16),
    beta = sigmoid(b); one kernel on Metal."""
    a = a.astype(mx.float32) + dt_bias.astype(mx.float32)
    g = -mx.exp(a_log.astype(mx.float32)) * nn.softplus(a)
    return g, mx.sigmoid(b.astype(mx.float32))

