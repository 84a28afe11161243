"""`metal-serve doctor`: pass/fail per case, exit codes, and a broken kernel caught."""

from __future__ import annotations

import argparse

from markers import requires_emulator

from kernels_metal import decode, doctor, emulator


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    doctor.add_doctor_arguments(parser)
    return doctor.run_doctor(parser.parse_args(argv))


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
