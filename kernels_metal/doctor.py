"""`metal-serve doctor`: run every attention kernel against the reference on this machine.

On a Mac the kernels run on the GPU; `--emulate` runs the same grid through the MSL emulator
(needs clang-19), which is the only option off Apple Silicon.
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx

from kernels_metal.cases import Case, check, grid
from kernels_metal.paged import PagedAttentionKernels
from kernels_metal.plan import PlanOptions

EXIT_FAILED = 1
EXIT_NOTHING_TO_CHECK = 2


def add_doctor_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--emulate", action="store_true",
                        help="run the kernels through the MSL emulator (clang-19) instead of "
                             "the GPU")
    parser.add_argument("--only", metavar="TEXT",
                        help="run only the cases whose name contains TEXT (e.g. bfloat16-d128)")


def run_doctor(args: argparse.Namespace) -> int:
    """Print PASS/FAIL and the max error per case; 0 if all pass, 1 if any fail, 2 if none ran."""
    metal_kernel = _kernel_factory(args.emulate)
    if metal_kernel is None:
        return EXIT_NOTHING_TO_CHECK
    cases = [c for c in grid() if not args.only or args.only in c.name]
    failed = 0
    for case in cases:
        ok, line = _run_case(metal_kernel, case)
        failed += not ok
        print(line, flush=True)
    print(f"{len(cases) - failed}/{len(cases)} kernel cases passed")
    return EXIT_FAILED if failed else 0


def _kernel_factory(emulate: bool):
    if emulate:
        from kernels_metal import emulator

        if not emulator.available():
            print("--emulate needs clang 19 on PATH (apt-get install clang-19).")
            return None
        print("Running the Metal kernels through the MSL emulator (CPU).")
        return emulator.metal_kernel
    if mx.metal.is_available():
        name = mx.device_info().get("device_name", "Metal device")
        print(f"Running the Metal kernels on {name}.")
        return mx.fast.metal_kernel
    print("No Metal device here: the attention kernels only run on Apple Silicon, and this "
          "machine serves with the pure-MLX reference.")
    from kernels_metal.emulator import available

    if available():
        print("clang-19 is installed: `metal-serve doctor --emulate` runs the same checks "
              "through the MSL emulator.")
    return None


def _run_case(metal_kernel, case: Case) -> tuple[bool, str]:
    start = time.perf_counter()
    try:
        options = PlanOptions(partition_size=case.partition_size)
        kernels = PagedAttentionKernels(metal_kernel, options)
        result = check(kernels, case)
    except Exception as exc:  # report every case, even when one cannot build or run
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return False, f"FAIL  {case.name}  {type(exc).__name__}: {first}"
    ms = (time.perf_counter() - start) * 1e3
    status = "PASS" if result.passed else "FAIL"
    return result.passed, (f"{status}  {case.name}  max error {result.max_error:.3g} "
                           f"({result.worst:.2f}x tolerance, {ms:.0f} ms)")
