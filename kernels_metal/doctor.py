"""`metal-serve doctor`: the Metal kernels on this machine, case by case and per variant.

On a Mac the kernels run on the GPU; `--emulate` runs them through the MSL emulator (needs a
clang). Either way every case of the attention check grid (float and int8/int4 pools) is
compared with the reference (PASS/FAIL), then each attention variant and each variant of the
gated-delta scan (`doctor_gated_delta.py`) gets its first-use check (what the dispatcher would
decide), every kernel launch of a step (how many, template, grid, threadgroup), the
threadgroup memory its source declares, what is known of the pipeline's thread limit and, on a
Mac, kernel vs reference timings with the achieved GB/s. Without Metal it says so and checks
what serves here instead. `--report FILE` keeps all of it, with the machine, in one file
(`doctor_report.py`).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from kernels_metal import attention, doctor_gated_delta
from kernels_metal.attention import Variant
from kernels_metal.cases import (
    DTYPES,
    HEAD_DIMS,
    KV_BITS,
    Case,
    case_sinks,
    check,
    grid,
    make_inputs,
    quantized_grid,
)
from kernels_metal.cost import step_cost
from kernels_metal.cpu import attention as cpu_attention
from kernels_metal.doctor_launches import LaunchLog, Timer, first_line, rate, time_on_gpu
from kernels_metal.doctor_report import device_info, machine_line, write_report
from kernels_metal.kv_quant import KVQuant
from kernels_metal.paged import PagedAttentionKernels
from kernels_metal.plan import PlanOptions
from kernels_metal.reference import paged_attention_reference

EXIT_FAILED = 1
EXIT_NOTHING_TO_CHECK = 2
REPORT_WINDOW, REPORT_SOFTCAP = 256, 50.0
NO_METAL = ("the Metal kernels on the GPU, their pipeline thread limits and GPU timings: no "
            "Metal device (only Apple Silicon has one)")

# One variant per (dtype, head dim) at GQA 4, then Gemma 2's shape (head dim 256, window, cap),
# Gemma 3's image prefill (head dim 256, window, rows that see their image's end) and GPT-OSS's
# (head dim 64, GQA 8, window, sinks); over int8 and int4 pools, every head dim in float16 and
# head dim 128 in the other dtypes; DeepSeek's latent rows (576, 512 values).
VARIANTS = [Variant(t, d, 16, 8, 2) for t in DTYPES for d in HEAD_DIMS] + [
    Variant(t, 256, 16, 8, 2, windowed=True, softcapped=True) for t in DTYPES] + [
    Variant(t, 256, 16, 8, 4, windowed=True, last_keys=True) for t in DTYPES] + [
    Variant(t, 64, 16, 8, 1, windowed=True, with_sinks=True) for t in DTYPES] + [
    Variant(t, d, 16, 8, 2, kv_bits=bits) for bits in KV_BITS for t in DTYPES
    for d in (HEAD_DIMS if t == mx.float16 else (128,))] + [
    Variant(t, 576, 16, 16, 1, value_dim=512) for t in DTYPES]  # MLA's latent rows


@dataclass(frozen=True)
class Workload:
    name: str
    requests: tuple[tuple[int, int], ...]  # (tokens cached before the step, query rows)


GPU_WORKLOADS = (Workload("decode 16 x 1024", ((1023, 1),) * 16),
                 Workload("prefill 512 after 1024", ((1024, 512),)))
EMULATED_WORKLOADS = (Workload("decode 2 x 40", ((39, 1), (20, 1))),
                      Workload("prefill 40 after 16", ((16, 40),)))


def add_doctor_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--emulate", action="store_true",
                        help="run the kernels through the MSL emulator (a clang) instead of "
                             "the GPU")
    parser.add_argument("--only", metavar="TEXT",
                        help="run only the cases and variants whose name contains TEXT "
                             "(e.g. bfloat16-d128, or bfloat16-dk128 for the gated-delta scan)")
    parser.add_argument("--no-timing", action="store_true",
                        help="skip the kernel vs reference timings")
    parser.add_argument("--report", metavar="FILE", type=Path,
                        help="also write everything, with this machine's details, to FILE "
                             "(Markdown) to attach to a bug report")


def run_doctor(args: argparse.Namespace) -> int:
    """0 if every case and variant passes, 1 if any fails, 2 if the kernels cannot run here."""
    if args.report is None:
        return run_checks(args, [])
    return write_report(args.report, command_line(args), lambda missing: run_checks(args, missing))


def run_checks(args: argparse.Namespace, missing: list[str]) -> int:
    """Print every check; append to `missing` what could not run on this machine."""
    print(machine_line(), flush=True)
    if not args.emulate and not mx.metal.is_available():
        return _without_metal(args.only, missing)
    metal_kernel = _kernel_factory(args.emulate)
    if metal_kernel is None:
        missing.append(f"the MSL emulator: {_emulator_reason()}")
        return EXIT_NOTHING_TO_CHECK
    if args.emulate:
        missing.append("timings and pipeline thread limits: the emulator runs the kernels' MSL "
                       "on the CPU (only a Mac's GPU shows them)")
    elif args.no_timing:
        missing.append("timings: skipped (--no-timing)")
    failed = _run_grid(metal_kernel, args.only)
    variants = [v for v in VARIANTS if not args.only or args.only in v.name]
    timer = None if args.emulate or args.no_timing else time_on_gpu
    workloads = EMULATED_WORKLOADS if args.emulate else GPU_WORKLOADS
    failed += report_variants(metal_kernel, variants, workloads, timer, emulated=args.emulate)
    failed += doctor_gated_delta.report_scan(metal_kernel, args.only, timer, args.emulate)
    return EXIT_FAILED if failed else 0


def command_line(args: argparse.Namespace) -> str:
    options = ["--emulate"] * args.emulate + ["--no-timing"] * args.no_timing
    options += [f"--only {args.only}"] * bool(args.only) + [f"--report {args.report}"]
    return " ".join(["metal-serve doctor", *options])


def _kernel_factory(emulate: bool):
    if emulate:
        from kernels_metal import emulator

        if (reason := emulator.unavailable_reason()) is not None:
            print(f"--emulate cannot run here: {reason}.")
            return None
        print("Running the Metal kernels through the MSL emulator (CPU).")
        return emulator.metal_kernel
    print(f"Running the Metal kernels on {device_info()}.")
    return mx.fast.metal_kernel


def _emulator_reason() -> str | None:
    from kernels_metal import emulator

    return emulator.unavailable_reason()


def _without_metal(only: str | None, missing: list[str]) -> int:
    """Say what is missing, and check what serves attention and the gated delta rule here."""
    info = ", ".join(str(v) for v in mx.device_info().values())
    print(f"No Metal device here: mx.metal.is_available() is False; MLX {mx.__version__} runs "
          f"on {mx.default_device()} ({info}).")
    print("The attention kernels run only on Apple Silicon: their pipeline thread limits, "
          "threadgroup memory and GPU timings can only be reported on a Mac.")
    missing.append(NO_METAL)
    served = "; ".join(f"{str(t).removeprefix('mlx.core.')}: {_backend_here(t)}" for t in DTYPES)
    print(f"Checked instead: the attention this machine serves with ({served}) against the "
          "pure-MLX reference in float32, over the kernels' check grid.")
    cases = [c for c in (*grid(), *quantized_grid()) if not only or only in c.name]
    failed = [c for c in cases if not check(attention.paged_attention, c).passed]
    for case in failed:
        print(f"FAIL  {case.name}")
    print(f"{len(cases) - len(failed)}/{len(cases)} cases passed on this machine's attention")
    scan_failed = doctor_gated_delta.check_served_here(only, missing)
    if (reason := _emulator_reason()) is None:
        print("A clang that builds the MSL emulator is installed: `metal-serve doctor --emulate` "
              "runs the Metal kernels' MSL through it (correctness and launch configuration, "
              "no timings).")
    else:
        missing.append(f"the MSL emulator (`--emulate`): {reason}")
    return EXIT_FAILED if failed or scan_failed else EXIT_NOTHING_TO_CHECK


def _backend_here(dtype: mx.Dtype) -> str:
    if mx.default_device() == mx.cpu and dtype in cpu_attention.NUMPY_DTYPES:
        return "numpy on MLX's CPU backend"
    return "the pure-MLX reference"


def _run_grid(metal_kernel, only: str | None) -> int:
    cases = [c for c in grid() + quantized_grid() if not only or only in c.name]
    if not cases:
        return 0
    failed = 0
    for case in cases:
        ok, line = _run_case(metal_kernel, case)
        failed += not ok
        print(line, flush=True)
    print(f"{len(cases) - failed}/{len(cases)} kernel cases passed")
    return failed


def _run_case(metal_kernel, case: Case) -> tuple[bool, str]:
    start = time.perf_counter()
    try:
        options = PlanOptions(partition_size=case.partition_size)
        kernels = PagedAttentionKernels(metal_kernel, options)
        result = check(kernels, case)
    except Exception as exc:  # report every case, even when one cannot build or run
        return False, f"FAIL  {case.name}  {type(exc).__name__}: {first_line(exc)}"
    ms = (time.perf_counter() - start) * 1e3
    status = "PASS" if result.passed else "FAIL"
    return result.passed, (f"{status}  {case.name}  max error {result.max_error:.3g} "
                           f"({result.worst:.2f}x tolerance, {ms:.0f} ms)")


def report_variants(metal_kernel, variants: list[Variant], workloads, timer: Timer | None,
                    emulated: bool = False) -> int:
    """Print per variant: first-use check, launches, memory, thread limit, timings.

    Returns how many variants failed their first-use check (the dispatcher would send them
    to the reference). `timer` None: no timings (the emulator, `--no-timing`).
    """
    if not variants:
        return 0
    print("\nPer variant (dtype, KV bits, head dim, block size, heads, window/softcap/sinks). "
          "MLX's Python API does not expose a kernel's pipeline: its thread limit "
          "(maxTotalThreadsPerThreadgroup) shows only when MLX refuses a launch above it; the "
          "threadgroup memory is what the kernel source declares.")
    failed = 0
    for variant in variants:
        kernels = PagedAttentionKernels(metal_kernel)
        reason = attention.check_variant(kernels, variant, REPORT_WINDOW, REPORT_SOFTCAP)
        failed += reason is not None
        verdict = ("passes its first-use check: the kernels serve it" if reason is None else
                   f"FAILS its first-use check, the reference serves it: {first_line(reason)}")
        print(f"{variant.name}  {verdict}", flush=True)
        for workload in workloads:
            _report_workload(metal_kernel, kernels, variant, workload, timer, emulated)
    return failed


def _report_workload(metal_kernel, kernels, variant, workload, timer, emulated) -> None:
    case = workload_case(variant, workload)
    inputs = make_inputs(case)
    log = LaunchLog(metal_kernel)
    print(f"  {workload.name}:")
    failure = None
    try:
        PagedAttentionKernels(log)(*inputs, case.window, case.softcap, case_sinks(case),
                                   value_dim=case.value_dim)
    except Exception as exc:  # the launches before it are still worth printing
        failure = f"{type(exc).__name__}: {first_line(exc)}"
    log.print_launches(emulated, failure)
    if timer is not None and not log.failed:
        print(f"    {timing_line(kernels, case, inputs, timer)}", flush=True)


def workload_case(variant: Variant, workload: Workload) -> Case:
    return Case(variant.dtype, variant.head_dim, variant.block_size, variant.num_heads,
                variant.kv_heads, workload.requests,
                window=REPORT_WINDOW if variant.windowed else None,
                softcap=REPORT_SOFTCAP if variant.softcapped else None,
                sinks=variant.with_sinks, kv_bits=variant.kv_bits, value_dim=variant.value_dim)


def timing_line(kernels, case: Case, inputs, timer: Timer) -> str:
    """Kernels vs reference on one step: tokens/s and GB/s of the kernels' modelled traffic
    (kernels_metal/cost.py, K/V reads and the other traffic; write_kv is not timed)."""
    q, k_pool, v_pool, meta, scale = inputs
    quant = KVQuant(case.kv_bits) if case.kv_bits else None
    cost = step_cost(meta, case.num_heads, case.kv_heads, case.head_dim, case.dtype.size,
                     case.window, kv_quant=quant, value_dim=case.value_dim)
    moved = cost.kv_read_bytes + cost.other_bytes
    values = v_pool if case.value_dim is None else k_pool[..., : case.value_dim]
    args = (q, k_pool, values, meta, scale, case.window, case.softcap, case_sinks(case))
    kernel_s = timer(lambda: kernels(*args, value_dim=case.value_dim))
    reference_s = timer(lambda: paged_attention_reference(*args))

    return (f"kernels {rate(q.shape[0], moved, kernel_s)}; reference "
            f"{rate(q.shape[0], moved, reference_s)} ({reference_s / kernel_s:.1f}x)")
