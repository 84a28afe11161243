"""The ops backends by name (kernels_metal.ops), and the one for this device.

    metal       MetalOps: `mx.fast` and the Metal kernels (a Mac)
    reference   ReferenceOps: pure MLX, anywhere (MLX's CUDA backend)
    host        HostOps: the CPU host loops (MLX's CPU backend)
"""

from __future__ import annotations

import mlx.core as mx

from kernels_metal.cpu.ops import HostOps
from kernels_metal.ops import MetalOps, Ops, OpsName, ReferenceOps

BACKENDS: dict[str, type[Ops]] = {"metal": MetalOps, "reference": ReferenceOps, "host": HostOps}


def ops_named(name: OpsName) -> Ops:
    """A fresh backend (each model gets its own: a backend may keep state per model)."""
    if name not in BACKENDS:
        raise ValueError(f"no ops backend {name!r}; there are {', '.join(BACKENDS)}")
    return BACKENDS[name]()


def device_ops_name() -> OpsName:
    """The backend for the default device: Metal kernels on a Mac, the host loops on MLX's
    CPU backend, the pure-MLX reference elsewhere (CUDA)."""
    if mx.metal.is_available():
        return "metal"
    return "host" if mx.default_device() == mx.cpu else "reference"
