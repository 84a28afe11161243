"""The engine with the Metal kernels swapped in (run by the MSL emulator) vs the engine with
the attention it uses here (the CPU backend's)."""

from __future__ import annotations

import numpy as np
from engine_helpers import generate_greedy, make_runner_and_scheduler
from markers import requires_emulator
from tiny_models import WINDOW, build_tiny_model

from kernels_metal import attention, emulator
from kernels_metal.paged import PagedAttentionKernels
from kernels_metal.plan import PlanOptions

pytestmark = requires_emulator


class CountingKernels(PagedAttentionKernels):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.decode_steps = self.prefill_steps = self.mixed_steps = self.split_steps = 0
        self.windowed_calls = self.softcapped_calls = 0

    def prepare(self, q, k_pool, meta, scale, window=None, softcap=None, value_dim=None):
        """Counted once per step and kind of layer: how the dispatcher serves a step."""
        self.windowed_calls += window is not None
        self.softcapped_calls += softcap is not None
        plan = self.plan(meta, q.shape[1], k_pool.shape[2], window)
        self.decode_steps += plan.decode is not None
        self.prefill_steps += plan.prefill is not None
        self.mixed_steps += plan.decode is not None and plan.prefill is not None
        self.split_steps += plan.decode is not None and plan.decode.num_parts > 1
        return super().prepare(q, k_pool, meta, scale, window, softcap, value_dim)


def greedy_without_and_with_kernels(path, prompts, max_tokens):
    """Greedy outputs without and with the emulated kernels, and the kernels' counts.

    A small token budget mixes prefill chunks and decodes in the same steps; block size 8 and
    16-key partitions make contexts cross many blocks and split-K partitions.
    """
    budget = dict(max_num_batched_tokens=20, block_size=8)
    expected = generate_greedy(*make_runner_and_scheduler(path, **budget), prompts, max_tokens)
    kernels = CountingKernels(emulator.metal_kernel, PlanOptions(partition_size=16))
    with attention.use_kernels(kernels):
        got = generate_greedy(*make_runner_and_scheduler(path, **budget), prompts, max_tokens)
    return expected, got, kernels


def test_mixed_batch_greedy_tokens_match_the_default_backend(tiny_llama):
    _, path = tiny_llama
    rng = np.random.default_rng(7)
    prompts = {f"r{i}": list(rng.integers(3, 128, size=n)) for i, n in
               enumerate([3, 17, 40, 9, 33, 1])}
    expected, got, kernels = greedy_without_and_with_kernels(path, prompts, max_tokens=8)
    assert got == expected
    assert kernels.mixed_steps > 0 and kernels.split_steps > 0


def test_sliding_window_and_softcapped_model_matches_the_default_backend(tmp_path):
    """Gemma 2: windowed layers interleaved with global ones, soft-capped scores."""
    build_tiny_model("gemma2", tmp_path)
    rng = np.random.default_rng(8)
    prompts = {f"r{i}": list(rng.integers(3, 128, size=n)) for i, n in
               enumerate([5 * WINDOW, 2, 3 * WINDOW + 1, 11])}
    expected, got, kernels = greedy_without_and_with_kernels(tmp_path, prompts, max_tokens=6)
    assert got == expected
    assert kernels.windowed_calls > 0 and kernels.softcapped_calls > kernels.windowed_calls
