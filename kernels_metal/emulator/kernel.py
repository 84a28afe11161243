"""`metal_kernel`: the same factory and call signature as `mx.fast.metal_kernel`, run on the CPU.

A call builds the source MLX would compile (signature.py), translates it to C++
(translate.py), compiles it once (build.py) and runs the dispatch on the fiber runtime twice,
with threads and threadgroups in opposite orders. Outputs must match bit for bit: a result
that depends on the order threads run in is a race (a missing barrier).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from pathlib import Path

import mlx.core as mx
import numpy as np

from kernels_metal.emulator import build
from kernels_metal.emulator.signature import GeneratedKernel, InputSpec, Parameter, generate
from kernels_metal.emulator.translate import MSLUnsupportedError, translate

# Thread orders every dispatch runs in: 0 = ascending, 1 = descending, n >= 2 = shuffled by n.
DEFAULT_ORDERS = (0, 1)
# compile_options["math_mode"] -> MSL_MATH_MODE of the compatibility header (msl_math.h).
MATH_MODES = {"safe": 0, "relaxed": 1, "fast": 2}

_NUMPY = {
    mx.float32: np.float32, mx.float16: np.float16, mx.bfloat16: np.uint16,
    mx.float64: np.float64, mx.bool_: np.bool_, mx.int8: np.int8, mx.int16: np.int16,
    mx.int32: np.int32, mx.int64: np.int64, mx.uint8: np.uint8, mx.uint16: np.uint16,
    mx.uint32: np.uint32, mx.uint64: np.uint64,
}


class KernelFault(RuntimeError):
    """The emulated kernel did something a GPU would not survive or define (OOB, deadlock...)."""


class OutOfBoundsError(KernelFault):
    """A device read or write outside its buffer."""


class RaceError(KernelFault):
    """The outputs depend on the order threads run in: a missing barrier or a data race."""


def metal_kernel(
    name: str, input_names: Sequence[str], output_names: Sequence[str], source: str,
    header: str = "", ensure_row_contiguous: bool = True, atomic_outputs: bool = False,
    compile_options: dict | None = None, orders: Sequence[int] = DEFAULT_ORDERS,
) -> EmulatedKernel:
    """Drop-in for `mx.fast.metal_kernel` that runs the kernel through the emulator."""
    if atomic_outputs:
        raise MSLUnsupportedError("MSL construct not supported by the emulator: atomic_outputs")
    math_mode = _math_mode(compile_options)
    return EmulatedKernel(name, list(input_names), list(output_names), source, header, orders,
                          math_mode)


def _math_mode(compile_options: dict | None) -> str:
    """The math mode, checked as `mx.fast.metal_kernel` checks it (same messages)."""
    options = dict(compile_options or {})
    for key in options:
        if key != "math_mode":
            raise ValueError(f"[metal_kernel] Unknown compile option `{key}`.")
    mode = options.get("math_mode", "safe")
    if mode not in MATH_MODES:
        raise ValueError("[metal_kernel] Expected math_mode to be 'safe', 'relaxed', or 'fast'.")
    return mode


def to_numpy(a: mx.array) -> np.ndarray:
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.ascontiguousarray(np.array(a))


def from_numpy(a: np.ndarray, dtype: mx.Dtype) -> mx.array:
    out = mx.array(a)
    return out.view(mx.bfloat16) if dtype == mx.bfloat16 else out


class EmulatedKernel:
    def __init__(self, name, input_names, output_names, source, header, orders,
                 math_mode="safe"):
        self.name, self.input_names, self.output_names = name, input_names, output_names
        self.source, self.header, self.orders = source, header, tuple(orders)
        self.math_mode = math_mode
        self._libraries: dict[str, tuple[ctypes.CDLL, int]] = {}

    def generate(self, inputs: list[mx.array], output_dtypes, template=None) -> GeneratedKernel:
        specs = [InputSpec(n, a.dtype, a.ndim, a.size)
                 for n, a in zip(self.input_names, inputs, strict=True)]
        return generate(self.name, self.input_names, self.output_names, self.source,
                        self.header, specs, list(output_dtypes), template)

    def __call__(
        self, *, inputs, output_shapes, output_dtypes, grid, threadgroup, template=None,
        init_value=None, verbose=False, stream=None,
    ) -> list[mx.array]:
        arrays = [x if isinstance(x, mx.array) else mx.array(x) for x in inputs]
        kernel = self.generate(arrays, output_dtypes, template)
        if verbose:
            print(f"Generated source code for `{self.name}`:\n```\n{kernel.source}\n```")
        entry = self._entry(kernel)
        host = [to_numpy(a) for a in arrays]
        results = None
        for order in self.orders:
            outs = _dispatch(entry, kernel, host, output_shapes, output_dtypes, grid,
                             threadgroup, init_value, order)
            if results is None:
                results = outs
            else:
                _require_same(results, outs, self.output_names, order)
        return [from_numpy(o, d) for o, d in zip(results, output_dtypes, strict=True)]

    def _entry(self, kernel: GeneratedKernel) -> int:
        if kernel.source not in self._libraries:
            self._libraries[kernel.source] = load(kernel, self.math_mode)
        return self._libraries[kernel.source][1]


_loaded: dict[Path, tuple[ctypes.CDLL, int]] = {}


def kernel_cpp(kernel: GeneratedKernel, math_mode: str = "safe") -> str:
    """The C++ translation unit for one generated kernel: headers, source, launcher."""
    translated = translate(kernel.source).cpp
    args = ", ".join(_argument(p, i) for i, p in enumerate(_buffers(kernel)))
    attrs = [f"t->{p.name}" for p in kernel.parameters if p.kind == "attribute"]
    call_args = ", ".join(filter(None, [args, ", ".join(attrs)]))
    return (
        f"#define MSL_MATH_MODE {MATH_MODES[math_mode]}\n"
        '#include "msl_compat.h"\n#include "mlx_utils.h"\n'
        f'#line 1 "{kernel.name}.metal"\n{translated}\n'
        '#line 1 "launcher"\n'
        'extern "C" void msl_entry(void* const* b, const msl_thread_info* t) {\n'
        f"  {kernel.name}{kernel.template_def}({call_args});\n}}\n"
    )


def load(kernel: GeneratedKernel, math_mode: str = "safe") -> tuple[ctypes.CDLL, int]:
    build.runtime_library()
    path = build.build_kernel(kernel_cpp(kernel, math_mode))
    if path not in _loaded:
        lib = ctypes.CDLL(str(path))
        _loaded[path] = (lib, ctypes.cast(lib.msl_entry, ctypes.c_void_p).value)
    return _loaded[path]


def _buffers(kernel: GeneratedKernel) -> list[Parameter]:
    return [p for p in kernel.parameters if p.kind != "attribute"]


def _argument(p: Parameter, i: int) -> str:
    const = "" if p.kind == "output" else "const "
    if p.by_reference:
        return f"*({const}{p.ctype}*)b[{i}]"
    return f"({const}{p.ctype}*)b[{i}]"


def _host_buffers(kernel: GeneratedKernel, host: list[np.ndarray]) -> list[np.ndarray]:
    """Inputs and their shape/stride/ndim buffers, in binding order."""
    out = []
    for p in _buffers(kernel):
        if p.kind == "input":
            out.append(host[p.input_index])
        elif p.kind == "shape":
            out.append(np.array(host[p.input_index].shape, np.int32))
        elif p.kind == "strides":
            a = host[p.input_index]
            out.append(np.array([s // a.itemsize for s in a.strides], np.int64))
        elif p.kind == "ndim":
            out.append(np.array([host[p.input_index].ndim], np.int32))
    return out


def _dispatch(entry, kernel, host, output_shapes, output_dtypes, grid, threadgroup,
              init_value, order) -> list[np.ndarray]:
    rt = build.runtime_library()
    buffers = _buffers(kernel)
    inputs = _host_buffers(kernel, host)
    outputs = [np.full(tuple(s), init_value if init_value is not None else 0, _NUMPY[d])
               for s, d in zip(output_shapes, output_dtypes, strict=True)]
    if init_value is not None and output_dtypes and mx.bfloat16 in output_dtypes:
        outputs = [_fill_bf16(o, init_value) if d == mx.bfloat16 else o
                   for o, d in zip(outputs, output_dtypes, strict=True)]
    pointers: list[int] = []
    try:
        data = iter(inputs + outputs)
        for p in buffers:
            arr = next(data)
            # Odd orders place buffers against the guard page in front of them instead.
            ptr = rt.msl_buffer_alloc(arr.nbytes, p.name.encode(), order % 2)
            if not ptr:
                raise MemoryError(f"cannot map an emulated buffer of {arr.nbytes} bytes")
            pointers.append(ptr)
            if p.kind != "output" or init_value is not None:
                ctypes.memmove(ptr, arr.ctypes.data, arr.nbytes)
            if p.kind != "output":
                rt.msl_buffer_set_readonly(ptr, 1)
        argv = (ctypes.c_void_p * max(len(pointers), 1))(*pointers)
        err = ctypes.create_string_buffer(4096)
        g = (ctypes.c_uint32 * 3)(*grid)
        t = (ctypes.c_uint32 * 3)(*threadgroup)
        if rt.msl_run(entry, argv, g, t, order, err, len(err)):
            raise _fault(kernel.name, err.value.decode())
        for ptr in pointers:
            if rt.msl_buffer_check(ptr, err, len(err)):
                raise _fault(kernel.name, err.value.decode())
        for ptr, out in zip(pointers[len(inputs):], outputs, strict=True):
            ctypes.memmove(out.ctypes.data, ptr, out.nbytes)
        return outputs
    finally:
        for ptr in pointers:
            rt.msl_buffer_free(ptr)


def _fill_bf16(out: np.ndarray, value: float) -> np.ndarray:
    bits = np.array([value], np.float32).view(np.uint32) >> 16
    return np.full(out.shape, bits[0], np.uint16)


def _fault(name: str, message: str) -> KernelFault:
    cls = OutOfBoundsError if message.startswith("out-of-bounds") else KernelFault
    return cls(f"{name}: {message}")


def _require_same(first, again, names, order) -> None:
    for a, b, name in zip(first, again, names, strict=True):
        if a.tobytes() == b.tobytes():
            continue
        flat_a, flat_b = a.reshape(-1), b.reshape(-1)
        where = _first_difference(flat_a, flat_b)
        raise RaceError(
            f"output '{name}' differs when threads run in order {order}: element {where} is "
            f"{flat_a[where]!r} in one run and {flat_b[where]!r} in the other "
            "(a missing barrier or a data race between threads)"
        )


def _first_difference(a: np.ndarray, b: np.ndarray) -> int:
    bytes_a = a.view(np.uint8).reshape(a.size, -1)
    bytes_b = b.view(np.uint8).reshape(b.size, -1)
    return int(np.flatnonzero((bytes_a != bytes_b).any(axis=1))[0])
