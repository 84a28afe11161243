"""`metal-serve doctor`: the attention kernels on this machine, case by case and per variant.

On a Mac the kernels run on the GPU; `--emulate` runs them through the MSL emulator (needs
clang-19). Either way every case of the check grid is compared with the reference (PASS/FAIL),
then each variant gets its first-use check (what the dispatcher would decide), every kernel
launch (template, grid, threadgroup), the threadgroup memory its source declares, what is
known of the pipeline's thread limit and, on a Mac, kernel vs reference timings. Without Metal
it says so and checks the attention this machine serves with against the reference instead.

MLX 0.32's Python API exposes `mx.metal.is_available()` and `mx.device_info()` (device name,
architecture, memory sizes), not a `metal_kernel`'s pipeline: its maxTotalThreadsPerThreadgroup
shows only when MLX refuses a launch above it (the message names the limit), and its threadgroup
memory is read here from the kernel source's `threadgroup` declarations.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import math
import operator
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

from kernels_metal import attention, cpu_attention
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
from kernels_metal.kv_quant import KVQuant
from kernels_metal.paged import PagedAttentionKernels
from kernels_metal.plan import PlanOptions
from kernels_metal.reference import paged_attention_reference

EXIT_FAILED = 1
EXIT_NOTHING_TO_CHECK = 2
THREADGROUP_MEMORY = 32768  # Apple GPUs' threadgroup memory per threadgroup
REPORT_WINDOW, REPORT_SOFTCAP = 256, 50.0

# One variant per (dtype, head dim) at GQA 4, then Gemma 2's shape (head dim 256, window, cap)
# and GPT-OSS's (head dim 64, GQA 8, window, sinks); over int8 and int4 pools, every head dim
# in float16 and head dim 128 in the other dtypes.
VARIANTS = [Variant(t, d, 16, 8, 2) for t in DTYPES for d in HEAD_DIMS] + [
    Variant(t, 256, 16, 8, 2, windowed=True, softcapped=True) for t in DTYPES] + [
    Variant(t, 64, 16, 8, 1, windowed=True, with_sinks=True) for t in DTYPES] + [
    Variant(t, d, 16, 8, 2, kv_bits=bits) for bits in KV_BITS for t in DTYPES
    for d in (HEAD_DIMS if t == mx.float16 else (128,))]

Timer = Callable[[Callable[[], mx.array]], float]  # seconds one call of the thunk takes


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
                        help="run the kernels through the MSL emulator (clang-19) instead of "
                             "the GPU")
    parser.add_argument("--only", metavar="TEXT",
                        help="run only the cases and variants whose name contains TEXT "
                             "(e.g. bfloat16-d128)")
    parser.add_argument("--no-timing", action="store_true",
                        help="skip the kernel vs reference timings")


def run_doctor(args: argparse.Namespace) -> int:
    """0 if every case and variant passes, 1 if any fails, 2 if the kernels cannot run here."""
    if not args.emulate and not mx.metal.is_available():
        return _without_metal(args.only)
    metal_kernel = _kernel_factory(args.emulate)
    if metal_kernel is None:
        return EXIT_NOTHING_TO_CHECK
    failed = _run_grid(metal_kernel, args.only)
    variants = [v for v in VARIANTS if not args.only or args.only in v.name]
    timer = None if args.emulate or args.no_timing else time_on_gpu
    workloads = EMULATED_WORKLOADS if args.emulate else GPU_WORKLOADS
    failed += report_variants(metal_kernel, variants, workloads, timer, emulated=args.emulate)
    return EXIT_FAILED if failed else 0


def _kernel_factory(emulate: bool):
    if emulate:
        from kernels_metal import emulator

        if not emulator.available():
            print("--emulate needs clang 19 on PATH (apt-get install clang-19).")
            return None
        print("Running the Metal kernels through the MSL emulator (CPU).")
        return emulator.metal_kernel
    print(f"Running the Metal kernels on {_device_info()}.")
    return mx.fast.metal_kernel


def _device_info() -> str:
    """`mx.device_info()` as one line, byte counts in GiB."""
    def shown(value) -> str:
        big = isinstance(value, int) and value > 2**24
        return f"{value / 2**30:.1f} GiB" if big else str(value)

    return ", ".join(f"{k} {shown(v)}" for k, v in sorted(mx.device_info().items()))


def _without_metal(only: str | None) -> int:
    """Say what is missing, and check what serves attention here instead."""
    info = ", ".join(str(v) for v in mx.device_info().values())
    print(f"No Metal device here: mx.metal.is_available() is False; MLX {mx.__version__} runs "
          f"on {mx.default_device()} ({info}).")
    print("The attention kernels run only on Apple Silicon: their pipeline thread limits, "
          "threadgroup memory and GPU timings can only be reported on a Mac.")
    served = "; ".join(f"{str(t).removeprefix('mlx.core.')}: {_backend_here(t)}" for t in DTYPES)
    print(f"Checked instead: the attention this machine serves with ({served}) against the "
          "pure-MLX reference in float32, over the kernels' check grid.")
    cases = [c for c in (*grid(), *quantized_grid()) if not only or only in c.name]
    failed = [c for c in cases if not check(attention.paged_attention, c).passed]
    for case in failed:
        print(f"FAIL  {case.name}")
    print(f"{len(cases) - len(failed)}/{len(cases)} cases passed on this machine's attention")
    from kernels_metal.emulator import available

    if available():
        print("clang-19 is installed: `metal-serve doctor --emulate` runs the Metal kernels' "
              "MSL through the emulator (correctness and launch configuration, no timings).")
    return EXIT_FAILED if failed else EXIT_NOTHING_TO_CHECK


def _backend_here(dtype: mx.Dtype) -> str:
    if mx.default_device() == mx.cpu and dtype in cpu_attention.NUMPY_DTYPES:
        return "numpy on MLX's CPU backend"
    return "the pure-MLX reference"


def _run_grid(metal_kernel, only: str | None) -> int:
    cases = [c for c in grid() + quantized_grid() if not only or only in c.name]
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
        return False, f"FAIL  {case.name}  {type(exc).__name__}: {_first_line(exc)}"
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
                   f"FAILS its first-use check, the reference serves it: {_first_line(reason)}")
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
        PagedAttentionKernels(log)(*inputs, case.window, case.softcap, case_sinks(case))
    except Exception as exc:  # the launches before it are still worth printing
        failure = f"{type(exc).__name__}: {_first_line(exc)}"
    for launch in log.launches:
        print(f"    {launch.describe(emulated)}")
    if failure is not None and not any(launch.error for launch in log.launches):
        print(f"    failed before a kernel launched: {failure}")
    if timer is not None and not any(launch.error for launch in log.launches):
        print(f"    {timing_line(kernels, case, inputs, timer)}", flush=True)


def workload_case(variant: Variant, workload: Workload) -> Case:
    return Case(variant.dtype, variant.head_dim, variant.block_size, variant.num_heads,
                variant.kv_heads, workload.requests,
                window=REPORT_WINDOW if variant.windowed else None,
                softcap=REPORT_SOFTCAP if variant.softcapped else None,
                sinks=variant.with_sinks, kv_bits=variant.kv_bits)


def timing_line(kernels, case: Case, inputs, timer: Timer) -> str:
    """Kernels vs reference on one step: tokens/s and GB/s of the kernels' modelled traffic
    (kernels_metal/cost.py, K/V reads and the other traffic; write_kv is not timed)."""
    q, k_pool, v_pool, meta, scale = inputs
    quant = KVQuant(case.kv_bits) if case.kv_bits else None
    cost = step_cost(meta, case.num_heads, case.kv_heads, case.head_dim, case.dtype.size,
                     case.window, kv_quant=quant)
    moved = cost.kv_read_bytes + cost.other_bytes
    args = (q, k_pool, v_pool, meta, scale, case.window, case.softcap, case_sinks(case))
    kernel_s = timer(lambda: kernels(*args))
    reference_s = timer(lambda: paged_attention_reference(*args))

    def rate(seconds: float) -> str:
        return f"{q.shape[0] / seconds:,.0f} tokens/s, {moved / seconds / 1e9:.3g} GB/s"

    return (f"kernels {rate(kernel_s)}; reference {rate(reference_s)} "
            f"({reference_s / kernel_s:.1f}x)")


def time_on_gpu(fn: Callable[[], mx.array], reps: int = 10) -> float:
    mx.eval(fn())  # compiles, builds the plan
    mx.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        mx.eval(fn())
    mx.synchronize()
    return (time.perf_counter() - start) / reps


@dataclass
class Launch:
    kernel: str
    template: dict
    grid: tuple[int, ...]
    threadgroup: tuple[int, ...]
    threadgroup_bytes: int | None  # what the source declares at this template; None: unread
    error: str | None = None

    def describe(self, emulated: bool) -> str:
        template = " ".join(f"{k}={str(v).removeprefix('mlx.core.')}"
                            for k, v in self.template.items())
        memory = ("threadgroup memory unknown" if self.threadgroup_bytes is None else
                  f"threadgroup memory {self.threadgroup_bytes:,} of {THREADGROUP_MEMORY:,} B")
        return (f"{self.kernel} [{template}] grid {self.grid} threadgroup "
                f"{math.prod(self.threadgroup)}, {memory}, {self.thread_limit(emulated)}")

    def thread_limit(self, emulated: bool) -> str:
        threads = math.prod(self.threadgroup)
        if self.error is not None:
            limit = re.search(r"maximum allowed threads per threadgroup \((\d+)\)", self.error)
            if limit:
                return f"pipeline thread limit {limit.group(1)} < {threads}: launch refused"
            return f"launch failed: {_first_line(self.error)}"
        if emulated:
            return "pipeline thread limit not modelled (the emulator takes up to 1024)"
        return f"pipeline thread limit >= {threads} (the launch ran)"


class LaunchLog:
    """A `metal_kernel` factory that records each launch and evaluates it on the spot, so a
    failure (MLX refusing the threadgroup, a compile error) is pinned on its kernel."""

    def __init__(self, metal_kernel) -> None:
        self.metal_kernel = metal_kernel
        self.launches: list[Launch] = []

    def __call__(self, **spec):
        kernel = self.metal_kernel(**spec)

        def launch(**call):
            template = dict(call.get("template") or ())
            record = Launch(spec["name"], template, tuple(call["grid"]),
                            tuple(call["threadgroup"]),
                            declared_threadgroup_bytes(spec["source"], template))
            self.launches.append(record)
            try:
                outputs = kernel(**call)
                mx.eval(outputs)
            except Exception as exc:
                record.error = f"{type(exc).__name__}: {exc}"
                raise
            return outputs
        return launch


_CONSTEXPR_INT = re.compile(r"constexpr\s+int\s+(\w+)\s*=\s*([^;]+);")
_THREADGROUP_ARRAY = re.compile(r"threadgroup\s+(\w+)\s+\w+\s*\[([^\]]+)\]\s*;")
_SCALAR_BYTES = {"float": 4, "int": 4, "uint": 4, "half": 2, "bfloat": 2, "bfloat16_t": 2,
                 "short": 2, "ushort": 2, "char": 1, "uchar": 1, "bool": 1}
# MSL's vector types (`uint4`: 16 bytes; the kernels stage K/V tiles as them); a 3-vector
# takes the room of a 4-vector.
_SCALAR_BYTES |= {f"{name}{n}": size * (4 if n == 3 else n)
                  for name, size in list(_SCALAR_BYTES.items()) if name != "bfloat16_t"
                  for n in (2, 3, 4)}
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.floordiv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}


def declared_threadgroup_bytes(source: str, template: dict) -> int | None:
    """Bytes of the `threadgroup TYPE name[N];` arrays in `source` at the template's values
    (N over `constexpr int`s, template ints and `sizeof`); None if one is not that simple."""
    sizes = dict(_SCALAR_BYTES)
    sizes.update({k: v.size for k, v in template.items() if isinstance(v, mx.Dtype)})
    names = {k: int(v) for k, v in template.items() if isinstance(v, int)}

    def value(expr: str) -> int:
        expr = re.sub(r"sizeof\s*\(\s*(\w+)\s*\)", lambda m: str(sizes[m.group(1)]), expr)
        return _evaluate(ast.parse(expr.strip(), mode="eval").body, names)

    for name, expr in _CONSTEXPR_INT.findall(source):
        with contextlib.suppress(KeyError, SyntaxError, ValueError):  # then its arrays are not
            names[name] = value(expr)
    try:
        return sum(sizes[t] * value(n) for t, n in _THREADGROUP_ARRAY.findall(source))
    except (KeyError, SyntaxError, ValueError):
        return None


def _evaluate(node: ast.expr, names: dict[str, int]) -> int:
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.Name):
        return names[node.id]
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.left, names), _evaluate(node.right, names))
    raise ValueError(f"not an integer expression: {ast.dump(node)}")


def _first_line(text) -> str:
    lines = str(text).strip().splitlines()
    return lines[0] if lines else ""
