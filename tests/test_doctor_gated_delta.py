"""`metal-serve doctor`'s gated-delta scan part: per-variant verdicts, the launch of a step and
its timings, driven by the emulator (as the GPU, with a fake timer, for the Mac path)."""

from __future__ import annotations

import argparse

import mlx.core as mx
import numpy as np
from markers import requires_emulator

from kernels_metal import doctor, doctor_gated_delta, emulator
from kernels_metal import gated_delta as gd
from kernels_metal.doctor_gated_delta import ScanWorkload, report_scan, scan_bytes

pytestmark = requires_emulator


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    doctor.add_doctor_arguments(parser)
    return doctor.run_doctor(parser.parse_args(argv))


def mutated(old: str, new: str):
    """Emulated kernels whose scan source carries `new` for `old`."""
    assert old in gd.SCAN_SOURCE

    def factory(**spec):
        if spec["name"] == "gated_delta_scan":
            spec = {**spec, "source": spec["source"].replace(old, new)}
        return emulator.metal_kernel(**spec)
    return factory


class RecordingTimer:
    """Runs each thunk once, keeps its result, and says it took the next of `seconds`."""

    def __init__(self, *seconds: float):
        self.seconds = iter(seconds)
        self.results: list[gd.DeltaRuleResult] = []

    def __call__(self, fn) -> float:
        self.results.append(fn())
        return next(self.seconds)


def test_emulated_scan_report_prints_the_verdict_and_the_one_launch(capsys):
    assert report_scan(emulator.metal_kernel, "float32-dk128", None, emulated=True) == 0
    lines = [line.strip() for line in capsys.readouterr().out.splitlines()]
    assert "float32-dk128-dv128-hk2hv4  passes its first-use check: the kernel serves it" in lines
    assert lines.count("1 kernel launch per layer and step") == 1
    launch = next(line for line in lines if line.startswith("gated_delta_scan"))
    assert launch.startswith("gated_delta_scan [T=float32 DK=128 DV=128 KG=8 NORMALIZE=True] "
                             "grid (256, 4, 12) threadgroup 256, threadgroup memory 0 B")
    assert "tokens/s" not in "\n".join(lines)


def test_a_wrong_scan_kernel_fails_its_first_use_check(capsys):
    broken = mutated("s[i] *= decay;", "")
    assert report_scan(broken, "float16-dk64", None, emulated=True) == 1
    out = capsys.readouterr().out
    assert "float16-dk64-dv64-hk1hv2  FAILS its first-use check, the reference serves it: " \
           "wrong result" in out


def test_the_mac_path_times_kernel_and_reference_in_gb_per_s(capsys, monkeypatch):
    workload = ScanWorkload("decode 3 and a run of 5", (1, 1, 5))
    monkeypatch.setattr(doctor_gated_delta, "GPU_SCAN_WORKLOADS", (workload,))
    monkeypatch.setattr(doctor_gated_delta, "TIMED_HEADS", (2, 6))
    timer = RecordingTimer(0.002, 0.010)
    assert report_scan(emulator.metal_kernel, "bfloat16-dk128-dv128-hk2hv4-no-l2norm", timer,
                       emulated=False) == 0
    out = capsys.readouterr().out
    assert "  decode 3 and a run of 5, 2 key / 6 value heads:" in out
    # q, k: 7 rows x 2 heads x 128; v and the output: 7 x 6 x 128 (bf16); g, beta: 7 x 6
    # float32; the state read and written: 3 requests x 6 heads x 128 x 128 float32.
    moved = 2 * 7 * 2 * 128 * 2 + 2 * 7 * 6 * 128 * 2 + 2 * 7 * 6 * 4 + 2 * 3 * 6 * 128 * 128 * 4
    variant = gd.Variant(mx.bfloat16, 128, 128, 2, 6, False)
    assert scan_bytes(gd.random_problem(variant, workload.rows)) == moved
    assert (f"kernel {7 / 0.002:,.0f} tokens/s, {moved / 0.002 / 1e9:.3g} GB/s; reference "
            f"{7 / 0.010:,.0f} tokens/s, {moved / 0.010 / 1e9:.3g} GB/s (5.0x)") in out
    kernel, reference = timer.results
    atol, rtol = gd.TOLERANCE[mx.bfloat16]
    for got, want in zip(kernel, reference, strict=True):
        np.testing.assert_allclose(np.array(got.astype(mx.float32)),
                                   np.array(want.astype(mx.float32)), atol=atol, rtol=rtol)


def test_emulated_doctor_checks_the_scan_after_attention(capsys):
    assert run(["--emulate", "--only", "dk64"]) == 0
    out = capsys.readouterr().out
    assert "Gated-delta scan per variant" in out
    assert "float16-dk64-dv64-hk1hv2  passes its first-use check" in out
    assert "kernel cases passed" not in out  # no attention case is named dk64
