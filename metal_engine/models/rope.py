"""Rotary position embedding over packed rows: each kind's frequencies, and its per-step
cos/sin tables or `mx.fast.rope` periods, built once per step and shared by all layers of
the kind (and by q and k).

Every row carries its own position (tables are `[total_q, 1, rotary_dim / 2]`). Rotation is
the non-interleaved ("rotate half") form over the first `rotary_dim` features; the rest pass
through (partial rotary).

Multimodal rope (M-RoPE: Qwen3-VL, Qwen3.5) gives image tokens 3-D positions (time, height,
width): a step with image rows passes positions `[3, total_q]` (text rows with three equal
ones), and each frequency turns by one axis, as `mrope_axes` assigns them. Steps without
image rows pass `[total_q]` and take the one-axis path unchanged.

Frequencies follow transformers' `modeling_rope_utils` for each kind. Two kinds depend on the
sequence length: transformers recomputes them from the longest position of a forward; here a
row uses its own request's context length after the step, which gives the same tables for a
sequence prefilled at once and then decoded, and does not depend on what else is batched.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from kernels_metal.metadata import AttentionMetadata
from metal_engine.loading.model_config import ModelConfig
from metal_engine.models.rope_parameters import RopeParameters

CONTEXT_DEPENDENT = ("dynamic", "longrope")


def frequencies(params: RopeParameters, dim: int, max_positions: int,
                context_len: int | None = None) -> tuple[np.ndarray, float]:
    """(inverse frequencies `[dim / 2]` in float64, scale of cos and sin)."""
    base = params.rope_theta
    exponents = np.arange(0, dim, 2, dtype=np.float64) / dim
    kind = params.rope_type
    if kind == "dynamic":
        length = max(context_len or max_positions, max_positions)
        base *= (params.factor * length / max_positions - (params.factor - 1)) ** (dim / (dim - 2))
    inv_freq = 1.0 / base**exponents
    if kind == "linear":
        return inv_freq / params.factor, 1.0
    if kind == "llama3":
        return _llama3(inv_freq, params), 1.0
    if kind == "yarn":
        return _yarn(inv_freq, params, dim, max_positions)
    if kind == "longrope":
        return _longrope(exponents, params, max_positions, context_len)
    if kind == "proportional":
        return _proportional(inv_freq, params), 1.0
    return inv_freq, 1.0


def _proportional(inv_freq: np.ndarray, p: RopeParameters) -> np.ndarray:
    """The whole head's frequencies, only the fastest `partial_rotary_factor` of them kept
    (the rest 0: those feature pairs do not rotate), slowed by `factor`."""
    rotated = int(p.partial_rotary_factor * len(inv_freq))
    kept = np.where(np.arange(len(inv_freq)) < rotated, inv_freq, 0.0)
    return kept / (p.factor or 1.0)


def _llama3(inv_freq: np.ndarray, p: RopeParameters) -> np.ndarray:
    """Long wavelengths slowed by `factor`, short ones kept, a smooth blend between."""
    original = p.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = original / p.low_freq_factor
    high_freq_wavelen = original / p.high_freq_factor
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / p.factor, inv_freq)
    smooth = (original / wavelen - p.low_freq_factor) / (p.high_freq_factor - p.low_freq_factor)
    smoothed = (1 - smooth) * scaled / p.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(medium, smoothed, scaled)


def _yarn(inv_freq: np.ndarray, p: RopeParameters, dim: int,
          max_positions: int) -> tuple[np.ndarray, float]:
    """Interpolate low frequencies, keep high ones (ramp between), and scale cos/sin."""
    original = p.original_max_position_embeddings
    factor = p.factor or max_positions / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = p.attention_factor
    if attention_factor is None:
        attention_factor = (mscale(factor, p.mscale) / mscale(factor, p.mscale_all_dim)
                            if p.mscale and p.mscale_all_dim else mscale(factor))

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(p.rope_theta))

    low, high = correction_dim(p.beta_fast or 32), correction_dim(p.beta_slow or 1)
    if p.truncate is not False:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid dividing by zero
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # share of the original (extrapolated) frequency
    return inv_freq / factor * (1 - keep) + inv_freq * keep, attention_factor


def _longrope(exponents: np.ndarray, p: RopeParameters, max_positions: int,
              context_len: int | None) -> tuple[np.ndarray, float]:
    """Per-frequency stretch factors: short ones up to the pretraining length, long beyond."""
    original = p.original_max_position_embeddings
    factor = p.factor or max_positions / original
    attention_factor = p.attention_factor
    if attention_factor is None:
        attention_factor = (1.0 if factor <= 1.0
                            else math.sqrt(1 + math.log(factor) / math.log(original)))
    long = context_len is not None and context_len > original
    stretch = np.array(p.long_factor if long else p.short_factor, dtype=np.float64)
    return 1.0 / (stretch * p.rope_theta**exponents), attention_factor


def mrope_axes(section: tuple[int, ...] | None, half: int) -> np.ndarray:
    """`[half]` int32: the position axis (0 time, 1 height, 2 width) each frequency turns by.
    Interleaved as transformers' Qwen3-VL and Qwen3.5 lay it out: height takes frequencies
    1, 4, 7, ... below `3 * section[1]`, width 2, 5, 8, ... below `3 * section[2]`, time the
    rest (those families interleave whatever `mrope_interleaved` says). No section: all time."""
    axes = np.zeros(half, np.int32)
    if section is not None:
        for axis in (1, 2):
            axes[axis:3 * section[axis]:3] = axis
    return axes


class RotaryEmbedding:
    """One rope kind: its frequencies, and each step's cos/sin tables or the periods
    `mx.fast.rope` takes (the backend says which: kernels_metal.ops)."""

    def __init__(self, params: RopeParameters, head_dim: int, max_position_embeddings: int):
        self.params = params
        # The proportional kind turns the whole head (its slow frequencies at 0).
        share = 1.0 if params.rope_type == "proportional" else params.partial_rotary_factor
        self.rotary_dim = int(head_dim * share)
        self.max_positions = max_position_embeddings
        inv_freq, self.scale = frequencies(params, self.rotary_dim, max_position_embeddings)
        self.inv_freq = inv_freq.astype(np.float32)
        self._inv_freq = mx.array(self.inv_freq)
        self.mrope_axes = mrope_axes(params.mrope_section, len(inv_freq))
        self._mrope_axes = mx.array(self.mrope_axes)
        # LongRoPE's frequencies change past the pretraining length; dynamic NTK's base
        # changes with every length.
        self.switches_at_length = params.rope_type == "longrope"
        self.switch_length = params.original_max_position_embeddings
        self.base_per_length = params.rope_type == "dynamic"
        self._periods = {long: self._periods_of(long) for long in (False, True)}
        # Evaluate now: a lazy array built here cannot be evaluated on the engine thread.
        mx.eval(self._inv_freq, self._mrope_axes, self._periods)

    def _periods_of(self, long: bool) -> mx.array:
        context = self.switch_length + 1 if long and self.switches_at_length else None
        inv_freq = frequencies(self.params, self.rotary_dim, self.max_positions, context)[0]
        with np.errstate(divide="ignore"):  # a frequency of 0 (proportional) never turns
            return mx.array((1.0 / inv_freq).astype(np.float32))

    def periods(self, long: bool = False) -> mx.array:
        """`[rotary_dim / 2]` float32 periods (`1 / inv_freq`), `mx.fast.rope`'s `freqs`;
        `long`: LongRoPE's past the pretraining length."""
        return self._periods[long]

    def tables(self, positions: mx.array,
               meta: AttentionMetadata) -> tuple[mx.array, mx.array]:
        """(cos, sin) float32, each `[total_q, 1, rotary_dim / 2]`, for rows at
        `positions` (`[total_q]`, or 3-D `[3, total_q]`)."""
        rows = self.row_frequencies(meta)
        inv_freq = self._inv_freq[None, :] if rows is None else mx.array(rows)
        if positions.ndim == 1:
            angles = positions.astype(mx.float32)[:, None] * inv_freq
        else:
            turned = positions[self._mrope_axes].T  # [total_q, half]: each frequency's axis
            angles = turned.astype(mx.float32) * inv_freq
        cos, sin = mx.cos(angles), mx.sin(angles)
        if self.scale != 1.0:
            cos, sin = cos * self.scale, sin * self.scale
        return cos[:, None, :], sin[:, None, :]

    def row_frequencies(self, meta: AttentionMetadata) -> np.ndarray | None:
        """`[total_q, rotary_dim / 2]`: each row's frequencies for its request's context, for
        the kinds that depend on it (None for the others: every row has `inv_freq`)."""
        if self.params.rope_type not in CONTEXT_DEPENDENT:
            return None
        contexts, table_row = np.unique(meta.seq_lens, return_inverse=True)
        table = np.stack([
            frequencies(self.params, self.rotary_dim, self.max_positions, int(c))[0]
            for c in contexts
        ]).astype(np.float32)
        rows = np.repeat(table_row, np.diff(meta.cu_seqlens_q))
        return table[rows]


class LayerRopes:
    """Each layer's rope kind; a backend builds each kind's step once (Gemma 3 has a local and
    a global one) and the layers of that kind share it."""

    def __init__(self, cfg: ModelConfig) -> None:
        # A rope is its parameters and the head size it turns (Gemma 4's layers differ in both).
        layer_params = [(cfg.rope_for(cfg.layer_type(i)), cfg.rope_head_dim(i))
                        for i in range(cfg.num_hidden_layers)]
        distinct = list(dict.fromkeys(layer_params))
        self.embeddings = [RotaryEmbedding(params, head_dim, cfg.max_position_embeddings)
                           for params, head_dim in distinct]
        # Each layer's index into `embeddings` (hashing the parameters every step cost ~1 us
        # a layer).
        self._of_layer = [distinct.index(key) for key in layer_params]
        self.num_layers = len(layer_params)

    def kind(self, layer: int) -> int:
        """Layer `layer`'s index into `embeddings`."""
        return self._of_layer[layer]
