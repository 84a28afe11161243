"""How a model's modules reach their ops backend (kernels_metal.ops), chosen once per model.

A module that computes through `self.ops` derives from `OpsUser`. Until its model hands it a
backend (`use_ops`, which `CausalLM` does when it is built) it uses the device's, made once
per process: a module built on its own (a test's, a speculative head's) computes as its
device does.
"""

from __future__ import annotations

from functools import cache

import mlx.nn as nn

from kernels_metal.backends import device_ops_name, ops_named
from kernels_metal.ops import Ops


@cache
def device_ops() -> Ops:
    return ops_named(device_ops_name())


class _DeviceOps:
    def __get__(self, obj, owner=None) -> Ops:
        return device_ops()


class OpsUser:
    """A mixin: `self.ops` is the backend this module computes with."""

    ops: Ops = _DeviceOps()


def use_ops(module: nn.Module, ops: Ops) -> None:
    """Every `OpsUser` in `module` (itself included) computes with `ops` from now on."""
    for m in module.modules():
        if isinstance(m, OpsUser):
            m.ops = ops
