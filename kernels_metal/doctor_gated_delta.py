"""`metal-serve doctor`'s part for the gated-delta scan (`gated_delta.GatedDeltaKernel`: the
Gated DeltaNet layers of Qwen3.5 and Qwen3-Next).

With kernels (a Mac's GPU, or `--emulate`), per variant: its first-use check (what the
dispatcher would decide), the launches of a step, their threadgroup memory and thread limit
and, on a Mac, kernel vs reference timings with the GB/s of the bytes the scan reads and
writes. Without Metal the scan cannot run: what serves instead (the pure-MLX reference,
chunked for long runs) is checked against the recurrent form.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from kernels_metal import gated_delta as gd
from kernels_metal.cases import DTYPES
from kernels_metal.doctor_launches import LaunchLog, Timer, first_line, rate

# The kernel is specialised on dtype, head dims and in-kernel l2 norms; heads only size the
# grid, so the checks take few (the emulator runs every thread) and the timed steps have
# Qwen3-Next's.
SCAN_VARIANTS = [gd.Variant(t, 128, 128, 2, 4, True) for t in DTYPES] + [
    gd.Variant(mx.bfloat16, 128, 128, 2, 4, False), gd.Variant(mx.float16, 64, 64, 1, 2, True)]
TIMED_HEADS = (16, 32)  # key heads, value heads
SERVED_CHECK_ROWS = (1, 70, 3, 0)  # decodes, a run across the reference's 64-row chunks, idle


@dataclass(frozen=True)
class ScanWorkload:
    name: str
    rows: tuple[int, ...]  # each request's rows in the step


GPU_SCAN_WORKLOADS = (ScanWorkload("decode 16 x 1", (1,) * 16),
                      ScanWorkload("prefill 512", (512,)))
EMULATED_SCAN_WORKLOADS = (ScanWorkload("decode 2 x 1 and a run of 9", (1, 1, 9)),)


def report_scan(metal_kernel, only: str | None, timer: Timer | None, emulated: bool) -> int:
    """Print per scan variant: first-use check, launches, memory, thread limit, timings.
    Returns how many failed their first-use check (the reference would serve them)."""
    variants = [v for v in SCAN_VARIANTS if not only or only in v.name]
    if not variants:
        return 0
    print("\nGated-delta scan per variant (dtype, key/value head dims, key/value heads, "
          "in-kernel l2 norms):")
    failed = 0
    for variant in variants:
        kernel = gd.GatedDeltaKernel(metal_kernel)
        reason = gd.check_variant(kernel, variant)
        failed += reason is not None
        verdict = ("passes its first-use check: the kernel serves it" if reason is None else
                   f"FAILS its first-use check, the reference serves it: {first_line(reason)}")
        print(f"{variant.name}  {verdict}", flush=True)
        for workload in EMULATED_SCAN_WORKLOADS if emulated else GPU_SCAN_WORKLOADS:
            _report_workload(metal_kernel, kernel, variant, workload, timer, emulated)
    return failed


def _report_workload(metal_kernel, kernel, variant: gd.Variant, workload: ScanWorkload,
                     timer: Timer | None, emulated: bool) -> None:
    if not emulated:
        variant = variant._replace(key_heads=TIMED_HEADS[0], value_heads=TIMED_HEADS[1])
    problem = gd.random_problem(variant, workload.rows)
    log = LaunchLog(metal_kernel)
    print(f"  {workload.name}, {variant.key_heads} key / {variant.value_heads} value heads:")
    failure = None
    try:
        gd.GatedDeltaKernel(log)(*problem, variant.normalize_qk)
    except Exception as exc:  # the launch is still worth printing
        failure = f"{type(exc).__name__}: {first_line(exc)}"
    log.print_launches(emulated, failure)
    if timer is not None and not log.failed:
        print(f"    {scan_timing_line(kernel, problem, variant.normalize_qk, timer)}", flush=True)


def scan_timing_line(kernel, problem: tuple, normalize_qk: bool, timer: Timer) -> str:
    """Kernel vs reference on one step: rows/s and GB/s of the bytes the scan moves."""
    kernel_s = timer(lambda: kernel(*problem, normalize_qk))
    reference_s = timer(lambda: gd.reference.gated_delta_rule(*problem, normalize_qk))
    rows, moved = problem[0].shape[0], scan_bytes(problem)
    return (f"kernel {rate(rows, moved, kernel_s)}; reference {rate(rows, moved, reference_s)} "
            f"({reference_s / kernel_s:.1f}x)")


def scan_bytes(problem: tuple) -> int:
    """What one scan call reads (q, k, v, g, beta, the state) and writes (the output, the
    state); the reference moves more, through its intermediates."""
    q, k, v, g, beta, _, state = problem
    return sum(x.nbytes for x in (q, k, v, g, beta, state)) + v.nbytes + state.nbytes


def check_served_here(only: str | None, missing: list[str]) -> int:
    """Without Metal: check the gated delta rule this machine serves with; returns how many
    variants failed."""
    variants = [v for v in SCAN_VARIANTS if not only or only in v.name]
    if not variants:
        return 0
    missing.append("the gated-delta scan kernel (gated_delta_scan) on the GPU: no Metal device")
    print("The gated-delta scan kernel runs only on Apple Silicon too. Checked instead: the "
          "gated delta rule this machine serves with (the pure-MLX reference, chunked for "
          "long runs) against its recurrent form in float32.")
    failed = 0
    for variant in variants:
        problem = gd.random_problem(variant, SERVED_CHECK_ROWS)
        result = gd.gated_delta_rule(*problem, variant.normalize_qk)
        worst = gd.worst_error(result, problem, variant.normalize_qk)
        failed += worst > 1.0
        print(f"{'PASS' if worst <= 1.0 else 'FAIL'}  {variant.name}  {worst:.2f}x tolerance")
    print(f"{len(variants) - failed}/{len(variants)} gated-delta variants passed on this "
          "machine's gated delta rule")
    return failed
