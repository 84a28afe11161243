"""`metal-serve doctor`: what it checks without Metal, and its per-variant report (launches,
threadgroup memory, thread limits, timings) driven by the emulator and a fake timer."""

from __future__ import annotations

import argparse
import re

import mlx.core as mx
import numpy as np
from markers import requires_emulator

from kernels_metal import attention, decode, doctor, emulator, prefill
from kernels_metal.attention import Variant
from kernels_metal.cases import TOLERANCE, grid, make_inputs, quantized_grid
from kernels_metal.cost import step_cost
from kernels_metal.reference import paged_attention_reference

MLX_THREAD_LIMIT = ("Thread group size ({}) is greater than  the maximum allowed threads per "
                    "threadgroup ({}).")  # MLX's custom_kernel.cpp, word for word


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    doctor.add_doctor_arguments(parser)
    return doctor.run_doctor(parser.parse_args(argv))


class FakeTimer:
    """Runs each thunk once (keeping its output) and says it took the next of `seconds`."""

    def __init__(self, *seconds: float):
        self.seconds = iter(seconds)
        self.outputs: list[np.ndarray] = []

    def __call__(self, fn) -> float:
        self.outputs.append(np.array(fn().astype(mx.float32)))
        return next(self.seconds)


def thread_limited(limit_below_by: int):
    """Emulated kernels whose prefill pipeline at head dim 256 allows fewer threads than its
    launches ask for: MLX refuses such a launch with this message."""
    def factory(**spec):
        kernel = emulator.metal_kernel(**spec)

        def launch(**call):
            threads = int(np.prod(call["threadgroup"]))
            if spec["name"] == "paged_attention_prefill" and dict(call["template"])["D"] == 256:
                raise ValueError(MLX_THREAD_LIMIT.format(threads, threads - limit_below_by))
            return kernel(**call)
        return launch
    return factory


def test_without_metal_it_says_so_and_what_it_checked_instead(capsys):
    assert run([]) == doctor.EXIT_NOTHING_TO_CHECK
    out = capsys.readouterr().out
    assert "No Metal device here: mx.metal.is_available() is False" in out
    assert "can only be reported on a Mac" in out
    assert "Checked instead" in out and "float32: numpy on MLX's CPU backend" in out
    assert "bfloat16: the pure-MLX reference" in out
    total = len(grid()) + len(quantized_grid())  # float and int8/int4 pools
    assert f"{total}/{total} cases passed on this machine's attention" in out
    assert ("--emulate" in out) == emulator.available()


def test_without_metal_a_wrong_attention_here_fails(capsys, monkeypatch):
    def wrong(q, k_pool, v_pool, meta, scale, window=None, softcap=None, sinks=None):
        return paged_attention_reference(q, k_pool, v_pool, meta, scale, window, softcap,
                                         sinks) * 1.01

    monkeypatch.setattr(attention, "paged_attention", wrong)
    assert run(["--only", "float32-d64"]) == doctor.EXIT_FAILED
    out = capsys.readouterr().out
    fails = [line for line in out.splitlines() if line.startswith("FAIL")]
    cases = [c for c in grid() if "float32-d64" in c.name]
    assert len(fails) == len(cases) and f"0/{len(cases)} cases passed" in out


def test_declared_threadgroup_bytes_reads_the_source_at_its_template():
    source = """
      constexpr int LDK = D + 4 / sizeof(T);
      constexpr int NACC = (D + 31) / 32;
      constexpr float MASKED = -FLT_MAX;
      threadgroup float q_tg[8 * D];
      threadgroup T k_tg[TILE * LDK];
      threadgroup float* S = q_tg + 8;
    """
    got = doctor.declared_threadgroup_bytes(source, {"T": mx.float16, "D": 80, "TILE": 16})
    assert got == 4 * 8 * 80 + 2 * 16 * (80 + 2)
    assert doctor.declared_threadgroup_bytes("threadgroup T x[N];", {"T": mx.float32}) is None


def test_the_kernels_declared_threadgroup_memory_fits_for_every_variant():
    for variant in doctor.VARIANTS:
        size, d = variant.dtype.size, variant.head_dim
        base = {"T": variant.dtype, "D": d, "BS": variant.block_size}
        kl, kw, ldk, tile = decode.decode_layout(size, d)
        dec = doctor.declared_threadgroup_bytes(
            decode.DECODE_SOURCE, {**base, "TILE": tile, "KL": kl, "KW": kw, "LDK": ldk})
        pre = doctor.declared_threadgroup_bytes(
            prefill.PREFILL_SOURCE, {**base, "TK": prefill.prefill_tile(size, d)})
        assert dec is not None and pre is not None and 0 < max(dec, pre) <= 32768, variant


def report(capsys, metal_kernel, variant, timer, emulated=False):
    failed = doctor.report_variants(metal_kernel, [variant], doctor.EMULATED_WORKLOADS, timer,
                                    emulated)
    return failed, capsys.readouterr().out.splitlines()


@requires_emulator
def test_report_prints_each_launch_and_times_kernels_against_the_reference(capsys):
    variant = Variant(mx.float32, 64, 16, 8, 2, windowed=True, softcapped=True)
    timer = FakeTimer(0.002, 0.008, 0.004, 0.010)  # decode: kernels, reference; then prefill
    failed, lines = report(capsys, emulator.metal_kernel, variant, timer)
    assert failed == 0
    assert any(line.startswith(variant.name) and "passes its first-use check" in line
               for line in lines)
    launches = [line.strip() for line in lines if line.strip().startswith("paged_attention")]
    assert [line.split()[0] for line in launches] == ["paged_attention_decode",
                                                      "paged_attention_prefill"]
    assert all("pipeline thread limit >= " in line and " of 32,768 B" in line
               for line in launches)
    timings = [line.strip() for line in lines if line.strip().startswith("kernels ")]
    assert len(timings) == 2
    for (kernel_s, reference_s), workload, line in zip(
            [(0.002, 0.008), (0.004, 0.010)], doctor.EMULATED_WORKLOADS, timings, strict=True):
        case = doctor.workload_case(variant, workload)
        q, _, _, meta, _ = make_inputs(case)
        cost = step_cost(meta, 8, 2, 64, 4, case.window)
        moved = cost.kv_read_bytes + cost.other_bytes
        expected = [f"{q.shape[0] / s:,.0f} tokens/s, {moved / s / 1e9:.3g} GB/s"
                    for s in (kernel_s, reference_s)]
        assert line == (f"kernels {expected[0]}; reference {expected[1]} "
                        f"({reference_s / kernel_s:.1f}x)")
    atol, rtol = TOLERANCE[mx.float32]
    for kernels_out, reference_out in zip(timer.outputs[::2], timer.outputs[1::2], strict=True):
        np.testing.assert_allclose(kernels_out, reference_out, atol=atol, rtol=rtol)


@requires_emulator
def test_a_refused_launch_shows_the_pipeline_limit_and_the_fallback(capsys):
    variant = Variant(mx.float16, 256, 16, 8, 2)
    failed, lines = report(capsys, thread_limited(32), variant, FakeTimer(0.001, 0.002))
    assert failed == 1
    verdict = next(line for line in lines if line.startswith(variant.name))
    assert "FAILS its first-use check, the reference serves it" in verdict
    assert "maximum allowed threads per threadgroup" in verdict
    pre = next(line for line in lines if line.strip().startswith("paged_attention_prefill"))
    threads = int(re.search(r"threadgroup (\d+),", pre).group(1))
    assert f"pipeline thread limit {threads - 32} < {threads}: launch refused" in pre
    dec = next(line for line in lines if line.strip().startswith("paged_attention_decode"))
    assert "pipeline thread limit >= " in dec
    assert sum(line.strip().startswith("kernels ") for line in lines) == 1  # decode only


@requires_emulator
def test_emulated_doctor_reports_head_dim_256_with_window_and_softcap(capsys):
    assert run(["--emulate", "--only", "d256-bs16-h8kv2-window-softcap"]) == 0
    out = capsys.readouterr().out
    verdicts = [line for line in out.splitlines() if "first-use check" in line]
    assert len(verdicts) == 3 and all("passes" in line for line in verdicts)
    assert "not modelled (the emulator" in out and "tokens/s" not in out


@requires_emulator
def test_the_mac_path_end_to_end_with_the_emulator_as_its_gpu(capsys, monkeypatch):
    """`doctor` as on a Mac, where `mx.fast.metal_kernel` is the emulator and time is fake."""
    monkeypatch.setattr(mx.metal, "is_available", lambda: True)
    monkeypatch.setattr(mx.fast, "metal_kernel", emulator.metal_kernel)
    monkeypatch.setattr(mx, "device_info", lambda: {"device_name": "Apple M9", "memory_size":
                                                    64 * 2**30, "architecture": "applegpu_g99"})
    monkeypatch.setattr(doctor, "GPU_WORKLOADS", doctor.EMULATED_WORKLOADS)
    monkeypatch.setattr(doctor, "time_on_gpu", lambda fn: (mx.eval(fn()), 0.001)[1])
    assert run(["--only", "float32-d64-bs16-h8kv2"]) == 0
    out = capsys.readouterr().out
    assert ("Running the Metal kernels on architecture applegpu_g99, device_name Apple M9, "
            "memory_size 64.0 GiB.") in out
    assert "float32-d64-bs16-h8kv2  passes its first-use check" in out
    assert "(the launch ran)" in out and out.count("tokens/s") == 2 * 2  # kernels, reference


def test_time_on_gpu_times_an_evaluated_call():
    calls = []

    def work():
        calls.append(1)
        return mx.ones((64, 64)) @ mx.ones((64, 64))

    assert doctor.time_on_gpu(work, reps=3) > 0 and len(calls) == 4  # a warm-up, then 3
