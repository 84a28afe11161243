"""`metal-serve doctor`: what it checks without Metal, and its per-variant report (launches,
threadgroup memory, thread limits, timings) driven by the emulator and a fake timer."""

from __future__ import annotations

import argparse
import platform
import re

import mlx.core as mx
import numpy as np
import pytest
from markers import requires_emulator

from kernels_metal import attention, doctor, doctor_gated_delta, emulator
from kernels_metal import gated_delta as gd
from kernels_metal.attention import Variant
from kernels_metal.cases import TOLERANCE, grid, make_inputs, quantized_grid
from kernels_metal.cost import step_cost
from kernels_metal.reference import paged_attention_reference
from kernels_metal.threadgroup_memory import declared_threadgroup_bytes

NO_METAL = pytest.mark.skipif(mx.metal.is_available(),
                              reason="this machine has Metal: doctor runs the kernels on its GPU "
                                     "(test_on_metal_doctor_runs_the_kernels_on_the_gpu)")
ON_METAL = pytest.mark.skipif(not mx.metal.is_available(),
                              reason="needs Apple Silicon's Metal GPU")
MLX_THREAD_LIMIT = ("Thread group size ({}) is greater than  the maximum allowed threads per "
                    "threadgroup ({}).")  # MLX's custom_kernel.cpp, word for word


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    doctor.add_doctor_arguments(parser)
    return doctor.run_doctor(parser.parse_args(argv))


def scan_cases() -> int:
    return len(doctor_gated_delta.SCAN_VARIANTS)


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


@NO_METAL
def test_without_metal_it_says_so_and_what_it_checked_instead(capsys):
    assert run([]) == doctor.EXIT_NOTHING_TO_CHECK
    out = capsys.readouterr().out
    assert out.startswith(f"Machine: system {platform.system()} ")
    assert f"mlx {mx.__version__}" in out
    assert "No Metal device here: mx.metal.is_available() is False" in out
    assert "can only be reported on a Mac" in out
    assert "Checked instead" in out and "float32: numpy on MLX's CPU backend" in out
    assert "bfloat16: the pure-MLX reference" in out
    total = len(grid()) + len(quantized_grid())  # float and int8/int4 pools
    assert f"{total}/{total} cases passed on this machine's attention" in out
    assert "The gated-delta scan kernel runs only on Apple Silicon too" in out
    assert f"{scan_cases()}/{scan_cases()} gated-delta variants passed" in out
    assert ("--emulate" in out) == emulator.available()


@NO_METAL
def test_without_metal_a_wrong_gated_delta_rule_here_fails(capsys, monkeypatch):
    served = gd.gated_delta_rule

    def wrong(*args):
        out, state = served(*args)
        return gd.DeltaRuleResult(out * 1.01, state)

    monkeypatch.setattr(gd, "gated_delta_rule", wrong)
    assert run(["--only", "dk64"]) == doctor.EXIT_FAILED
    out = capsys.readouterr().out
    assert "FAIL  float16-dk64-dv64-hk1hv2" in out and "0/1 gated-delta variants passed" in out


@NO_METAL
def test_report_file_on_a_machine_without_metal_says_what_could_not_run(tmp_path, capsys):
    path = tmp_path / "doctor.md"
    assert run(["--only", "float32-d", "--report", str(path)]) == doctor.EXIT_NOTHING_TO_CHECK
    out = capsys.readouterr().out
    report = path.read_text()
    assert f"Report written to {path}" in out
    assert report.startswith("# metal-serve doctor report\n")
    assert f"- command: `metal-serve doctor --only float32-d --report {path}`" in report
    assert "- result: exit code 2, the Metal kernels could not run on this machine" in report
    facts = dict(re.findall(r"^\| ([^|]+) \| ([^|]+) \|$", report, re.MULTILINE))
    assert facts["mlx"] == mx.__version__ and facts["Metal"] == "not available"
    assert facts["system"].startswith(platform.system())
    assert facts["default device"] == str(mx.default_device())
    missing = report.split("## Could not run here")[1].split("## Output")[0]
    assert "- the Metal kernels on the GPU, their pipeline thread limits and GPU timings" in missing
    assert "- the gated-delta scan kernel (gated_delta_scan) on the GPU: no Metal device" in missing
    assert ("the MSL emulator" in missing) != emulator.available()
    # Every line the checks printed, verdicts and counts, in one fenced block.
    printed = out.split("Report written")[0].rstrip("\n")
    assert f"## Output\n\n```text\n{printed}\n```\n" in report
    cases = [c for c in grid() + quantized_grid() if "float32-d" in c.name]
    assert f"{len(cases)}/{len(cases)} cases passed" in report
    assert "1/1 gated-delta variants passed" in report  # float32-dk128-dv128-hk2hv4


def test_a_report_path_that_cannot_be_written_fails_before_the_checks(tmp_path, capsys):
    path = tmp_path / "no-such-dir" / "doctor.md"
    with pytest.raises(SystemExit, match=f"cannot write the report to {path}: No such file"):
        run(["--report", str(path)])
    assert capsys.readouterr().out == ""


@NO_METAL
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
    got = declared_threadgroup_bytes(source, {"T": mx.float16, "D": 80, "TILE": 16})
    assert got == 4 * 8 * 80 + 2 * 16 * (80 + 2)
    assert declared_threadgroup_bytes("threadgroup T x[N];", {"T": mx.float32}) is None


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
    assert all("pipeline thread limit >= " in line and
               " B (budget 28,672 of the 32,768 Metal allows)" in line for line in launches)
    assert lines.count("    1 kernel launch per layer and step") == 2
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


@requires_emulator
def test_kernels_per_step_counts_every_launch_of_a_mixed_split_step(capsys):
    """A long decode (split: two threadgroups fill no GPU) next to a prefill chunk: decode,
    reduce and the prefill launch, as many as the plan's own count of attention dispatches
    (`cost.step_cost`)."""
    variant = Variant(mx.float16, 64, 16, 8, 2)
    workload = doctor.Workload("split decode and a chunk", ((600, 1), (20, 9)))
    failed = doctor.report_variants(emulator.metal_kernel, [variant], [workload], None,
                                    emulated=True)
    lines = capsys.readouterr().out.splitlines()
    launches = [line.strip().split()[0] for line in lines
                if line.strip().startswith(("paged_attention", "gated_delta"))]
    meta = make_inputs(doctor.workload_case(variant, workload))[3]
    write_kv_scatters = 2
    expected = step_cost(meta, 8, 2, 64, 2).dispatches - write_kv_scatters
    assert failed == 0 and launches == ["paged_attention_decode", "paged_attention_reduce",
                                        "paged_attention_prefill"]
    assert f"    {expected} kernel launches per layer and step" in lines and expected == 3


@ON_METAL
def test_on_metal_doctor_runs_the_kernels_on_the_gpu(capsys, tmp_path):
    path = tmp_path / "doctor.md"
    assert run(["--only", "float32-d64-bs16-h8kv2", "--report", str(path)]) == 0
    out = capsys.readouterr().out
    assert "Running the Metal kernels on " in out and "device_name Apple" in out
    assert "float32-d64-bs16-h8kv2  passes its first-use check" in out
    assert "(the launch ran)" in out and "GB/s" in out
    report = path.read_text()
    assert "- result: exit code 0, every check passed" in report
    assert "| Metal | available |" in report and "| macOS | " in report
    assert "Nothing: every check ran." in report


def test_emulate_without_a_clang_says_why_and_the_report_lists_it(tmp_path, capsys, monkeypatch):
    from kernels_metal.emulator import build

    monkeypatch.setenv("METAL_SERVE_CLANG", "no-such-clang-anywhere")
    build.unavailable_reason.cache_clear()
    try:
        path = tmp_path / "doctor.md"
        assert run(["--emulate", "--report", str(path)]) == doctor.EXIT_NOTHING_TO_CHECK
    finally:
        build.unavailable_reason.cache_clear()
    out = capsys.readouterr().out
    assert "--emulate cannot run here: The MSL emulator needs " in out
    missing = path.read_text().split("## Could not run here")[1].split("## Output")[0]
    assert "- the MSL emulator: The MSL emulator needs " in missing
    assert "or set METAL_SERVE_CLANG" in missing
