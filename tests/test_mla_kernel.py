"""Multi-head latent attention on the decode kernel (template VK: the values are the first
`value_dim` elements of each staged latent row), run by the MSL emulator against the
pure-MLX reference over the paged latent pool; its dispatch; and a DeepSeek-shaped model's
logits through the emulated kernel against transformers."""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
import pytest
from engine_helpers import make_runner_and_scheduler
from markers import requires_emulator
from test_model_parity import TOL, random_ids, run_logits, torch_logits
from tiny_models import build_tiny_model

from convert import convert_model
from kernels_metal import attention, decode, emulator
from kernels_metal.cases import DTYPES, Case, check, make_inputs
from kernels_metal.paged import PagedAttentionKernels, latent_unsupported_reason
from kernels_metal.plan import PlanOptions

pytestmark = requires_emulator

# (latent width, values): DeepSeek V3 / GLM-4.7-Flash (512 + 64), a rank of 256 (+ 64).
SHAPES = ((576, 512), (320, 256))
# Decode rows over one and several blocks, a fresh prompt, and a chunk on a cached prefix:
# on the latent path every row of them goes to the decode kernel.
MIXED = ((70, 1), (0, 1), (0, 9), (21, 19))


def emulated(case: Case, factory=None) -> PagedAttentionKernels:
    return PagedAttentionKernels(factory or emulator.metal_kernel,
                                 PlanOptions(partition_size=case.partition_size))


GRID = [Case(dtype, width, block_size, heads, 1, MIXED, partition, value_dim=dv)
        for dtype, (width, dv), block_size, heads, partition in itertools.product(
            DTYPES, SHAPES, (16, 32), (4, 20), (None, 16))
        if block_size == 16 or partition is None]  # fmt: skip


# Quantized latent rows (codes and scales, not turned), staged dequantized to the queries'
# dtype as a quantized K pool's are.
GRID += [Case(dtype, width, 16, 20, 1, MIXED, partition, kv_bits=bits, value_dim=dv)
         for dtype, (width, dv), bits, partition in itertools.product(
             DTYPES, SHAPES, (8, 4), (None, 16))]  # fmt: skip


@pytest.mark.parametrize("case", GRID, ids=lambda c: c.name)
def test_latent_rows_match_the_reference(case: Case):
    result = check(emulated(case), case)
    assert result.passed, f"{case.name}: max error {result.max_error:g} ({result.worst:.2f}x tol)"


def mutated(old: str, new: str):
    """An emulator `metal_kernel` whose decode kernel carries `new` for `old`."""
    assert old in decode.DECODE_SOURCE

    def factory(**spec):
        spec["source"] = spec["source"].replace(old, new)
        return emulator.metal_kernel(**spec)
    return factory


MUTANTS = {  # what breaks: (old, new)
    "values-from-an-unstaged-tile": ("VK ? k_tg : (const threadgroup T*)v_raw",
                                     "(const threadgroup T*)v_raw"),
    "values-shifted": ("float(v_tg[j * LDK + d])", "float(v_tg[j * LDK + d + 8])"),
    "rope-key-in-the-values": ("if (DV == D || d < DV) {  // the elements past DV",
                               "if (d >= D - DV) {  // the elements past DV"),
    "split-output-at-the-key-stride": ("part_out[base * DV + d]", "part_out[base * D + d]"),
}


@pytest.mark.parametrize("mutant", MUTANTS)
def test_a_broken_latent_kernel_fails_the_comparison(mutant):
    case = Case(mx.float32, 576, 16, 4, 1, MIXED, 16, value_dim=512)
    assert check(emulated(case), case).passed
    try:
        result = check(emulated(case, mutated(*MUTANTS[mutant])), case)
    except Exception:  # an access out of bounds: the emulator's guard pages caught it
        return
    assert not result.worst <= 10.0, f"{mutant}: only {result.worst:.2f}x the tolerance"


def test_the_dispatcher_serves_latent_rows_with_a_checked_variant(monkeypatch):
    case = Case(mx.float16, 576, 16, 8, 1, MIXED, value_dim=512)
    q, pool, _, meta, scale = make_inputs(case)
    monkeypatch.setattr(attention, "_state", attention._Dispatch())
    kernels = emulated(case)
    with attention.use_kernels(kernels, first_use_check=True):
        out = attention.latent_attention(q, pool, 512, meta, scale)
        assert attention.kernel_fallbacks() == {}
    assert out.shape == (q.shape[0], 8, 512)
    np.testing.assert_array_equal(np.array(out), np.array(
        kernels(q, pool, pool, meta, scale, value_dim=512)))
    assert attention.variant_of(q, pool, value_dim=512).name == "float16-d576-dv512-bs16-h8kv1"


def test_what_the_kernel_does_not_take_is_named():
    q = mx.zeros((1, 4, 576), mx.float16)
    assert latent_unsupported_reason(q, mx.zeros((2, 16, 1, 576), mx.float16), 512) is None
    assert "heads" in latent_unsupported_reason(q, mx.zeros((2, 16, 2, 576), mx.float16), 512)
    assert "too large" in latent_unsupported_reason(q, mx.zeros((2, 16, 1, 1024),
                                                                mx.float32), 512)


def test_a_deepseek_model_through_the_emulated_kernel_matches_transformers(tmp_path):
    model = build_tiny_model("deepseek_v3", tmp_path / "hf")
    path = convert_model(tmp_path / "hf", tmp_path / "model", progress=False)
    runner, scheduler = make_runner_and_scheduler(path, block_size=8)
    runner.model.use_ops("metal")
    ids = random_ids(5, 30)
    kernels = LatentCalls(emulator.metal_kernel)
    with attention.use_kernels(kernels):
        got = run_logits(runner, scheduler, "a", ids, chunk=7)
    np.testing.assert_allclose(got, torch_logits(model, ids), atol=TOL, rtol=TOL)
    # Once a step, its layers sharing the launch; the first chunk, over no cached keys,
    # attends expanded (models/mla_forms.py), not through the latent kernel.
    assert kernels.latent_steps == -(-30 // 7) - 1


class LatentCalls(PagedAttentionKernels):
    latent_steps = 0

    def prepare(self, *args, value_dim=None, **kwargs):
        self.latent_steps += value_dim is not None
        return super().prepare(*args, value_dim=value_dim, **kwargs)
