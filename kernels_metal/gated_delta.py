"""Gated DeltaNet's gated delta rule as one Metal kernel, and the dispatch the model calls.

The kernel walks each request's rows in order with the state held in registers: decode rows
(one per request) are its one-step case, prefill chunks and short runs its longer case, all
requests of a packed step in one launch. S [Dk, Dv] (float32) is read once and written once
per call, however many rows a request has; the reference reads and writes it per row (or
per 64-row chunk). Launch geometry (threads):

    grid        = (32 * NSG, ceil(Dv / (NSG * CW)), num_seqs * Hv)
    threadgroup = 32 * NSG: NSG simdgroups, each owning CW value columns of one head
    lane        = kg * CW + c: column c of the simdgroup's CW, key rows kg, kg + KG, ...

Each column's KG = 32 / CW lanes split the key dim (NK = Dk / KG rows each) and add their
partial dot products (k S, q S, the l2 norms) with `simd_shuffle_xor`; a request's rows are
a loop inside the threadgroup, so nothing crosses simdgroups and there is no barrier.

Why a sequential scan and not the chunked (WY) form: one request's heads x column groups
already make ~1000 independent simdgroups (Hv 32, Dk = Dv = 128), a row costs a few FMAs
per lane and a log2(KG)-step shuffle on the dependency chain, and S never leaves the chip;
the chunked form's matmuls pay off where S would otherwise go through memory per row, as in
MLX ops.

    rows:        | req0: 5 rows | req1: 1 row | req2: 3 rows |
    cu_seqlens:  0              5             6              9
"""

from __future__ import annotations

import contextlib
import logging
from functools import cache, lru_cache
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from kernels_metal.dispatch import CheckedDispatch, describe
from metal_engine.models import gated_delta_rule as reference
from metal_engine.models.gated_delta_rule import DeltaRuleResult

log = logging.getLogger(__name__)

SUPPORTED_DTYPES = (mx.float16, mx.bfloat16, mx.float32)
MAX_KEY_DIM = 256
MAX_SIMDGROUPS = 8
# (atol, rtol) of the output against the recurrent reference in fp32 on the same rounded
# inputs: the output's rounding (half an ulp: 2^-11 fp16, 2^-8 bf16) plus fp32 sums in
# another order. The state is float32 in every variant: STATE_TOLERANCE.
TOLERANCE = {mx.float32: (1e-5, 1e-5), mx.float16: (1e-4, 1e-3), mx.bfloat16: (1e-3, 8e-3)}
STATE_TOLERANCE = (1e-5, 1e-5)

# params: [Hv, Hk, bits of Dk ** -0.5 as float32]; q, k [T, Hk, DK] and v, out [T, Hv, DV]
# in T; g, beta [T, Hv] float32; cu_seqlens [num_seqs + 1] int32; state_in, state_out
# [num_seqs, Hv, DK, DV] float32.
SCAN_SOURCE = """
  const int HV = params[0], HK = params[1];
  const float scale = as_type<float>(params[2]);  // the reference's Dk ** -0.5, rounded once
  constexpr float EPS = L2NORM_EPS;
  constexpr int CW = 32 / KG;  // value columns per simdgroup
  constexpr int NK = (DK + KG - 1) / KG;  // key rows per lane: kg, kg + KG, ...
  const int lane = int(thread_index_in_simdgroup);
  const int kg = lane / CW;
  const int col = (int(threadgroup_position_in_grid.y) * int(simdgroups_per_threadgroup)
                   + int(simdgroup_index_in_threadgroup)) * CW + lane % CW;
  const int bh = int(threadgroup_position_in_grid.z);  // request * HV + value head
  const int req = bh / HV, hv = bh - req * HV;
  const int hk = hv / (HV / HK);  // each key head serves HV / HK consecutive value heads
  const bool live = col < DV;  // lanes past DV compute on column 0 and write nothing
  const int c = live ? col : 0;

  float s[NK];
  const long s_base = long(bh) * DK * DV + c;
  #pragma clang loop unroll(full)
  for (int i = 0; i < NK; ++i) {
    const int d = kg + KG * i;
    s[i] = d < DK ? state_in[s_base + long(d) * DV] : 0.0f;
  }
  const int row_end = cu_seqlens[req + 1];
  for (int t = cu_seqlens[req]; t < row_end; ++t) {
    const long qk_base = (long(t) * HK + hk) * DK;
    float qr[NK], kr[NK];
    float qq = 0.0f, kk = 0.0f;
    #pragma clang loop unroll(full)
    for (int i = 0; i < NK; ++i) {
      const int d = kg + KG * i;
      qr[i] = d < DK ? float(q[qk_base + d]) : 0.0f;
      kr[i] = d < DK ? float(k[qk_base + d]) : 0.0f;
      qq += qr[i] * qr[i];
      kk += kr[i] * kr[i];
    }
    float q_norm = 1.0f, k_norm = 1.0f;
    if (NORMALIZE) {
      #pragma clang loop unroll(full)
      for (int m = CW; m < 32; m *= 2) {
        qq += simd_shuffle_xor(qq, ushort(m));
        kk += simd_shuffle_xor(kk, ushort(m));
      }
      q_norm = metal::precise::rsqrt(qq + EPS);
      k_norm = metal::precise::rsqrt(kk + EPS);
    }
    const int gh = t * HV + hv;
    const float decay = metal::precise::exp(g[gh]);
    float recalled = 0.0f;
    #pragma clang loop unroll(full)
    for (int i = 0; i < NK; ++i) {
      qr[i] = qr[i] * q_norm * scale;
      kr[i] = kr[i] * k_norm;
      s[i] *= decay;
      recalled += kr[i] * s[i];
    }
    #pragma clang loop unroll(full)
    for (int m = CW; m < 32; m *= 2) {
      recalled += simd_shuffle_xor(recalled, ushort(m));
    }
    const float delta = (float(v[long(gh) * DV + c]) - recalled) * beta[gh];
    float o = 0.0f;
    #pragma clang loop unroll(full)
    for (int i = 0; i < NK; ++i) {
      s[i] += kr[i] * delta;
      o += qr[i] * s[i];
    }
    #pragma clang loop unroll(full)
    for (int m = CW; m < 32; m *= 2) {
      o += simd_shuffle_xor(o, ushort(m));
    }
    if (live && kg == 0) {
      out[long(gh) * DV + c] = T(o);
    }
  }
  #pragma clang loop unroll(full)
  for (int i = 0; i < NK; ++i) {
    const int d = kg + KG * i;
    if (live && d < DK) {
      state_out[s_base + long(d) * DV] = s[i];
    }
  }
""".replace("L2NORM_EPS", f"{reference.L2NORM_EPS!r}f")


def scan_layout(key_dim: int, value_dim: int) -> tuple[int, int]:
    """(KG lanes per value column, NSG simdgroups per threadgroup): KG the power of two that
    leaves each lane at most 16 key rows (1..32); NSG so a threadgroup spans 32 columns
    (128 bytes of each state row) where the head has them, at most 8 simdgroups."""
    kg = 1
    while kg < 32 and -(-key_dim // kg) > 16:
        kg *= 2
    cw = 32 // kg
    return kg, max(1, min(MAX_SIMDGROUPS, -(-min(value_dim, 32) // cw)))


class Variant(NamedTuple):
    """What the kernel is specialised on, checked once, and falls back on."""

    dtype: mx.Dtype
    key_dim: int
    value_dim: int
    key_heads: int
    value_heads: int
    normalize_qk: bool

    @property
    def name(self) -> str:
        dtype = str(self.dtype).removeprefix("mlx.core.")
        return (f"{dtype}-dk{self.key_dim}-dv{self.value_dim}-hk{self.key_heads}"
                f"hv{self.value_heads}" + "-no-l2norm" * (not self.normalize_qk))


def variant_of(q: mx.array, v: mx.array, normalize_qk: bool = True) -> Variant:
    return Variant(v.dtype, q.shape[-1], v.shape[-1], q.shape[-2], v.shape[-2], normalize_qk)


def unsupported_reason(q: mx.array, k: mx.array, v: mx.array) -> str | None:
    """Why the kernel cannot take this call (the reference then serves it), or None."""
    if v.dtype not in SUPPORTED_DTYPES or q.dtype != v.dtype or k.dtype != v.dtype:
        return f"q/k/v dtypes {q.dtype}/{k.dtype}/{v.dtype} (one of fp16, bf16, fp32)"
    if q.shape[-1] > MAX_KEY_DIM:
        return f"key head dim {q.shape[-1]} (the kernel takes up to {MAX_KEY_DIM})"
    if v.shape[-2] % q.shape[-2]:
        return f"{v.shape[-2]} value heads over {q.shape[-2]} key heads"
    if q.shape[0] == 0:
        return "no rows"
    return None


class GatedDeltaKernel:
    """The scan kernel, built with any `metal_kernel` factory (the emulator's in tests)."""

    def __init__(self, metal_kernel=None, source: str = SCAN_SOURCE) -> None:
        self.kernel = (metal_kernel or mx.fast.metal_kernel)(
            name="gated_delta_scan",
            input_names=["q", "k", "v", "g", "beta", "cu_seqlens", "state_in", "params"],
            output_names=["out", "state_out"],
            source=source,
        )

    def __call__(self, q, k, v, g, beta, cu_seqlens, initial_state: mx.array,
                 normalize_qk: bool = True) -> DeltaRuleResult:
        """Same contract as `reference.gated_delta_rule`."""
        total, value_heads, value_dim = v.shape
        num_seqs, key_dim = initial_state.shape[0], q.shape[-1]
        kg, nsg = scan_layout(key_dim, value_dim)
        columns = nsg * (32 // kg)
        out, state = self.kernel(
            inputs=[q, k, v, g.astype(mx.float32), beta.astype(mx.float32),
                    _device_cu_seqlens(np.asarray(cu_seqlens, np.int32).tobytes()),
                    initial_state.astype(mx.float32),
                    _params(value_heads, q.shape[-2], key_dim)],
            template=[("T", v.dtype), ("DK", key_dim), ("DV", value_dim), ("KG", kg),
                      ("NORMALIZE", normalize_qk)],
            grid=(32 * nsg, -(-value_dim // columns), num_seqs * value_heads),
            threadgroup=(32 * nsg, 1, 1),
            output_shapes=[(total, value_heads, value_dim), initial_state.shape],
            output_dtypes=[v.dtype, mx.float32],
        )
        return DeltaRuleResult(out, state)


@lru_cache(maxsize=4)
def _device_cu_seqlens(cu_bytes: bytes) -> mx.array:
    """A step's int32 `cu_seqlens` on the device, made once for all its layers."""
    return mx.array(np.frombuffer(cu_bytes, np.int32))


@cache
def _params(value_heads: int, key_heads: int, key_dim: int) -> mx.array:
    scale_bits = int(np.array([key_dim**-0.5], np.float32).view(np.int32)[0])
    return mx.array([value_heads, key_heads, scale_bits], dtype=mx.int32)


# ---- dispatch: the kernel on Metal, judged per variant; the reference elsewhere ----

CHECK_LENS = (1, 5, 0, 2, 1)  # the first-use check's step: decodes, short runs, an idle request


class _Dispatch(CheckedDispatch[GatedDeltaKernel, Variant]):
    def __init__(self) -> None:
        # Names looked up per call, so that tests can swap the kernel or the check.
        super().__init__("gated delta", lambda factory: GatedDeltaKernel(factory),
                         lambda *args: check_variant(*args), log)

    @property
    def kernel(self) -> GatedDeltaKernel | None:  # the names tests read this family's state by
        return self.kernels

    @property
    def passed(self) -> set[Variant]:
        return self.verdicts.passed


_state = _Dispatch()


def gated_delta_rule(q, k, v, g, beta, cu_seqlens, initial_state: mx.array,
                     normalize_qk: bool = True) -> DeltaRuleResult:
    """`reference.gated_delta_rule` (same arguments and result), on the kernel where it
    serves this variant: Metal, a supported shape, and a passed first-use check."""
    def on_reference() -> DeltaRuleResult:
        return reference.gated_delta_rule(q, k, v, g, beta, cu_seqlens, initial_state,
                                          normalize_qk)

    if not _state.on_kernels() or unsupported_reason(q, k, v) is not None:
        return on_reference()
    # Rows and requests size the launch's inputs: with the variant, they decide its launches.
    return _state.call(variant_of(q, v, normalize_qk),
                       lambda kernel: kernel(q, k, v, g, beta, cu_seqlens, initial_state,
                                             normalize_qk),
                       on_reference, launches=(q.shape[0], initial_state.shape[0]))


def use_kernel(kernel: GatedDeltaKernel,
               first_use_check: bool = False) -> contextlib.AbstractContextManager[None]:
    """Serve every supported call with `kernel` (e.g. on the emulator in tests). With
    `first_use_check` each variant is checked and falls back as on a Mac, with verdicts of
    its own for the duration; without, the kernel's errors propagate."""
    return _state.use(kernel, first_use_check)


def kernel_fallbacks() -> dict[Variant, str]:
    """The variants served by the reference because their kernel failed, with the reason."""
    return dict(_state.active_verdicts.fallbacks)


# ---- random problems and the comparison, shared by the first-use check and the tests ----

def random_problem(variant: Variant, lens, seed: int = 0) -> tuple:
    """(q, k, v, g, beta, cu_seqlens, initial_state) for requests of `lens` rows; non-zero
    initial states. Without in-kernel l2 norms, q and k arrive unit-norm (as a caller
    would pass them: the rule is unstable for |k| > 1)."""
    rng = np.random.default_rng(seed)
    total, hk, hv = int(sum(lens)), variant.key_heads, variant.value_heads
    q, k = (rng.standard_normal((total, hk, variant.key_dim), np.float32) for _ in range(2))
    if not variant.normalize_qk:
        q, k = (x / np.linalg.norm(x, axis=-1, keepdims=True) for x in (q, k))
    v = rng.standard_normal((total, hv, variant.value_dim), np.float32)
    g = -rng.uniform(0, 1.5, (total, hv)).astype(np.float32)
    beta = rng.uniform(0, 1, (total, hv)).astype(np.float32)
    state = rng.standard_normal((len(lens), hv, variant.key_dim, variant.value_dim),
                                np.float32)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    qkv = [mx.array(x).astype(variant.dtype) for x in (q, k, v)]
    return (*qkv, mx.array(g), mx.array(beta), cu, mx.array(state))


def worst_error(result: DeltaRuleResult, problem: tuple, normalize_qk: bool = True) -> float:
    """The largest error of `result` against the recurrent reference in fp32 on the same
    (rounded) inputs, as a multiple of the tolerance (<= 1 passes; NaN is inf)."""
    f32 = [x.astype(mx.float32) for x in problem[:3]]
    expected = reference.recurrent_gated_delta_rule(*f32, *problem[3:], normalize_qk)
    dtype = problem[2].dtype
    if result.out.dtype != dtype or result.state.dtype != mx.float32:
        raise AssertionError(f"got {result.out.dtype} / {result.state.dtype} out / state, "
                             f"want {dtype} / float32")
    worst = 0.0
    for got, want, (atol, rtol) in ((result.out, expected.out, TOLERANCE[dtype]),
                                    (result.state, expected.state, STATE_TOLERANCE)):
        if got.shape != want.shape:
            raise AssertionError(f"got shape {got.shape}, want {want.shape}")
        want = np.array(want)
        err = np.abs(np.array(got.astype(mx.float32)) - want) / (atol + rtol * np.abs(want))
        worst = max(worst, float(err.max(initial=0.0)) if not np.isnan(err).any() else np.inf)
    return worst


def check_variant(kernel: GatedDeltaKernel, variant: Variant) -> str | None:
    """Run `kernel` on a small step of `variant` against the reference: None if they
    agree, else why not."""
    problem = random_problem(variant, CHECK_LENS)
    try:
        worst = worst_error(kernel(*problem, variant.normalize_qk), problem,
                            variant.normalize_qk)
    except Exception as exc:  # a compile error surfaces here, at the first evaluation
        return describe(exc)
    if worst > 1.0:
        return f"wrong result on a {variant.name} step: {worst:.3g}x the tolerance"
    return None
