"""What `metal-serve doctor` records of each kernel launch, and how it times a step.

MLX 0.32's Python API does not expose a `metal_kernel`'s pipeline: its
maxTotalThreadsPerThreadgroup shows only when MLX refuses a launch above it (the message
names the limit), and its threadgroup memory is read from the kernel source's `threadgroup`
declarations (`threadgroup_memory.py`).
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

from kernels_metal.decode import THREADGROUP_MEMORY, THREADGROUP_MEMORY_BUDGET
from kernels_metal.threadgroup_memory import declared_threadgroup_bytes

Timer = Callable[[Callable[[], object]], float]  # seconds one call of the thunk takes


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
                  f"threadgroup memory {self.threadgroup_bytes:,} B (budget "
                  f"{THREADGROUP_MEMORY_BUDGET:,} of the {THREADGROUP_MEMORY:,} Metal allows)")
        return (f"{self.kernel} [{template}] grid {self.grid} threadgroup "
                f"{math.prod(self.threadgroup)}, {memory}, {self.thread_limit(emulated)}")

    def thread_limit(self, emulated: bool) -> str:
        threads = math.prod(self.threadgroup)
        if self.error is not None:
            limit = re.search(r"maximum allowed threads per threadgroup \((\d+)\)", self.error)
            if limit:
                return f"pipeline thread limit {limit.group(1)} < {threads}: launch refused"
            return f"launch failed: {first_line(self.error)}"
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

    def print_launches(self, emulated: bool, failure: str | None) -> None:
        """Each launch, one line, under a line saying how many a layer's step takes."""
        count = len(self.launches)
        print(f"    {count} kernel launch{'es' * (count != 1)} per layer and step")
        for launch in self.launches:
            print(f"    {launch.describe(emulated)}")
        if failure is not None and not self.failed:
            print(f"    failed before a kernel launched: {failure}")

    @property
    def failed(self) -> bool:
        return any(launch.error for launch in self.launches)


def time_on_gpu(fn: Callable[[], object], reps: int = 10) -> float:
    mx.eval(fn())  # compiles, builds the plan
    mx.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        mx.eval(fn())
    mx.synchronize()
    return (time.perf_counter() - start) / reps


def rate(rows: int, moved_bytes: int, seconds: float) -> str:
    """Rows (tokens) per second and achieved GB/s of `moved_bytes` in `seconds`."""
    return f"{rows / seconds:,.0f} tokens/s, {moved_bytes / seconds / 1e9:.3g} GB/s"


def first_line(text) -> str:
    lines = str(text).strip().splitlines()
    return lines[0] if lines else ""
