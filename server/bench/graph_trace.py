"""What a step's graph would launch on Metal, read on any machine without running it.

A step is built lazily (nothing evaluated) and its graph is read from `mx.export_to_dot`:
every primitive node that computes is one kernel launch on Metal, a `Compiled` node (a fused
elementwise chain) included; views (reshape, broadcast, slice, transpose, split, ...) launch
nothing; a concatenate copies each of its inputs (one launch each, as MLX's Metal backend does).

Off a Mac, `mx.fast.metal_kernel` cannot be built and `mx.fast`'s rope, norms and attention
decompose into a dozen CPU ops each, where Metal runs one kernel. `metal_stand_ins()` swaps
each for a stand-in: one `Depends` node of the kernel's output shapes and dtypes over the
kernel's inputs. That keeps the graph's edges (everything upstream stays in the trace), adds
one node where Metal launches one kernel, and costs the host about what building the real
primitive does. Only stand-ins make `Depends` nodes in a traced step.

Host synchronizations are counted as calls that wait for the device: `mx.eval`,
`mx.synchronize`, `array.item()` / `.tolist()` and numpy reading an MLX array.
"""

from __future__ import annotations

import contextlib
import re
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import mlx.core as mx
import numpy as np

# Primitives that make a view of their input (or nothing at all): no kernel.
VIEWS = frozenset({
    "Reshape", "Broadcast", "BroadcastAxes", "Slice", "Transpose", "ExpandDims", "Squeeze",
    "AsStrided", "Split", "StopGradient", "Flatten", "Unflatten", "Real", "Imag",
})
STAND_IN = "Depends"
_NODE = re.compile(r'^\{ (\d+) \[label ="([^"]+)"')
_EDGE = re.compile(r'^"[^"]+" -> \d+$')


@dataclass(frozen=True)
class GraphCount:
    kernels: int  # launches on Metal
    by_primitive: dict[str, int]


def count_kernels(*outputs: mx.array) -> GraphCount:
    """The Metal launches of the unevaluated graph behind `outputs`."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "step.dot"
        mx.export_to_dot(str(path), *outputs)
        return parse_dot(path.read_text())


def parse_dot(dot: str) -> GraphCount:
    """Counts a node per primitive line: a compiled function's calls share one primitive (and
    one node id), each call printed as its own node line followed by its input edges."""
    nodes: list[list] = []  # [label, inputs] per node line, in order
    for line in dot.splitlines():
        if node := _NODE.match(line):
            nodes.append([node.group(2), 0])
        elif _EDGE.match(line) and nodes:
            nodes[-1][1] += 1
    by_primitive: Counter[str] = Counter()
    for label, inputs in nodes:
        if label in VIEWS:
            continue
        name = "Compiled" if label.startswith("Compiled") else label
        by_primitive[name] += inputs if label == "Concatenate" else 1
    return GraphCount(sum(by_primitive.values()), dict(by_primitive))


def stand_in(inputs: list[mx.array], shapes, dtypes) -> list[mx.array]:
    """One node over `inputs` with outputs of `shapes` / `dtypes` (zeros if evaluated)."""
    empty = [mx.broadcast_to(_zero(d), tuple(s)) for s, d in zip(shapes, dtypes, strict=True)]
    return mx.depends(empty, [x for x in inputs if isinstance(x, mx.array)])


@cache
def _zero(dtype: mx.Dtype) -> mx.array:
    zero = mx.array(0, dtype=dtype)
    mx.eval(zero)
    return zero


class StandInKernel:
    """What `mx.fast.metal_kernel(...)` returns, building a stand-in node when called."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __call__(self, inputs, output_shapes, output_dtypes, **_: object) -> list[mx.array]:
        return stand_in(list(inputs), output_shapes, output_dtypes)


def _rope(a, dims, *, traditional=False, base=None, scale=1.0, offset=0, freqs=None,
          stream=None):
    return stand_in([a, offset, freqs], [a.shape], [a.dtype])[0]


def _norm(x, *params, **_: object):
    return stand_in([x, *params], [x.shape], [x.dtype])[0]


def _sdpa(q, k, v, *, scale, mask=None, sinks=None, stream=None):
    return stand_in([q, k, v, mask, sinks], [(*q.shape[:-1], v.shape[-1])], [q.dtype])[0]


@contextlib.contextmanager
def metal_stand_ins() -> Iterator[None]:
    """`mx.fast`'s kernels as stand-ins, and Metal reported available (mlx-lm builds its
    kernels at import when it is)."""
    fast = mx.fast
    saved = (fast.metal_kernel, fast.rope, fast.rms_norm, fast.layer_norm,
             fast.scaled_dot_product_attention, mx.metal.is_available)
    fast.metal_kernel, fast.rope, fast.rms_norm, fast.layer_norm = (
        StandInKernel, _rope, _norm, _norm)
    fast.scaled_dot_product_attention = _sdpa
    mx.metal.is_available = lambda: True
    try:
        yield
    finally:
        (fast.metal_kernel, fast.rope, fast.rms_norm, fast.layer_norm,
         fast.scaled_dot_product_attention, mx.metal.is_available) = saved


@contextlib.contextmanager
def gpu_default_device() -> Iterator[None]:
    """`mx.default_device()` answers the GPU (mlx-lm picks its kernels by it)."""
    saved = mx.default_device
    mx.default_device = lambda: mx.gpu
    try:
        yield
    finally:
        mx.default_device = saved


def _gather_mm(a, b, lhs_indices=None, rhs_indices=None, *, sorted_indices=False, **_: object):
    batch = np.broadcast_shapes(*(i.shape for i in (lhs_indices, rhs_indices) if i is not None),
                                a.shape[:-2])
    return stand_in([a, b, lhs_indices, rhs_indices], [(*batch, a.shape[-2], b.shape[-1])],
                    [a.dtype])[0]


@contextlib.contextmanager
def cpu_evaluable() -> Iterator[None]:
    """`mx.gather_mm` as a stand-in: MLX's CPU backend runs it in float32 only, and a step is
    evaluated once (in the model's dtype) before it is traced."""
    saved = mx.gather_mm
    mx.gather_mm = _gather_mm
    try:
        yield
    finally:
        mx.gather_mm = saved


class SyncCounter:
    """Counts host waits on the device while active; nothing is evaluated (`mx.eval` and
    `mx.synchronize` do nothing, reads of MLX arrays give zeros of their shape)."""

    def __init__(self) -> None:
        self.count = 0

    @contextlib.contextmanager
    def active(self, numpy: bool = True) -> Iterator[SyncCounter]:
        """`numpy`: count numpy's reads of MLX arrays too (a wrapper around `np.asarray` and
        `np.array`, which slows the host: off while timing)."""
        patches: list[tuple[object, str, Callable]] = [
            (mx, "eval", self._wait(None)), (mx, "synchronize", self._wait(None)),
            (mx, "async_eval", lambda *a, **k: None),
            (mx.array, "item", self._wait(lambda a: 0)),
            (mx.array, "tolist", self._wait(lambda a: np.zeros(a.shape, np.int64).tolist())),
        ]
        if numpy:
            patches += [(np, "asarray", self._numpy(np.asarray)),
                        (np, "array", self._numpy(np.array))]
        saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
        for owner, name, patch in patches:
            setattr(owner, name, patch)
        try:
            yield self
        finally:
            for owner, name, original in saved:
                setattr(owner, name, original)

    def _wait(self, value: Callable | None):
        def wait(*args, **_: object):
            self.count += 1
            return None if value is None else value(args[0])
        return wait

    def _numpy(self, original: Callable):
        def read(a, *args, **kwargs):
            if isinstance(a, mx.array):
                self.count += 1
                return np.zeros(a.shape, _NUMPY.get(a.dtype, np.float32))
            return original(a, *args, **kwargs)
        return read


_NUMPY = {mx.int32: np.int32, mx.uint32: np.uint32, mx.int64: np.int64, mx.bool_: np.bool_,
          mx.float16: np.float16}
