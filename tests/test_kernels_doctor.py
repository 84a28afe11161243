"""`metal-serve doctor`: pass/fail per case, exit codes, and a broken kernel caught."""

from __future__ import annotations

import argparse

import mlx.core as mx
import pytest
from markers import requires_emulator

from kernels_metal import decode, doctor, emulator
from kernels_metal.attention import Variant
from kernels_metal.cases import make_inputs
from kernels_metal.cost import step_cost
from kernels_metal.kv_quant import KVQuant


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    doctor.add_doctor_arguments(parser)
    return doctor.run_doctor(parser.parse_args(argv))


@pytest.mark.skipif(mx.metal.is_available(),
                    reason="this machine has Metal: doctor runs the kernels on its GPU")
def test_without_metal_it_says_so_and_offers_the_emulator(capsys):
    assert run([]) == doctor.EXIT_NOTHING_TO_CHECK
    out = capsys.readouterr().out
    assert "No Metal device" in out
    assert ("--emulate" in out) == emulator.available()


@requires_emulator
def test_emulated_grid_passes(capsys):
    assert run(["--emulate", "--only", "float32-d80"]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith(("PASS", "FAIL"))]
    assert lines and all(line.startswith("PASS") and "max error" in line for line in lines)


@requires_emulator
def test_a_wrong_kernel_fails_with_exit_1(capsys, monkeypatch):
    wrong = decode.DECODE_SOURCE.replace("acc[k] * inv", "acc[k] * inv * 1.01f")
    monkeypatch.setattr(decode, "DECODE_SOURCE", wrong)
    assert run(["--emulate", "--only", "float32-d80"]) == doctor.EXIT_FAILED
    assert "FAIL" in capsys.readouterr().out


@requires_emulator
def test_emulated_doctor_checks_quantized_cases_and_variants(capsys):
    assert run(["--emulate", "--only", "float16-kv4-d80"]) == 0
    out = capsys.readouterr().out
    passed = [line for line in out.splitlines() if line.startswith("PASS")]
    assert passed and all("-kv4-d80-" in line for line in passed)
    assert "float16-kv4-d80-bs16-h8kv2  passes its first-use check" in out


@requires_emulator
def test_doctor_timings_count_a_quantized_pools_bytes(capsys):
    variant = Variant(mx.float16, 128, 16, 8, 2, kv_bits=8)
    workload = doctor.EMULATED_WORKLOADS[0]
    assert doctor.report_variants(emulator.metal_kernel, [variant], [workload],
                                  lambda _: 0.001) == 0
    case = doctor.workload_case(variant, workload)
    meta = make_inputs(case)[3]
    cost = step_cost(meta, 8, 2, 128, 2, kv_quant=KVQuant(8))
    moved = cost.kv_read_bytes + cost.other_bytes
    assert moved < sum(step_cost(meta, 8, 2, 128, 2).to_json()[k] for k in ("kv_read_bytes",
                                                                             "other_bytes"))
    assert f"{moved / 0.001 / 1e9:.3g} GB/s" in capsys.readouterr().out
