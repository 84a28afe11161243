"""How a model's modules reach their ops backend (kernels_metal.ops), chosen once per model.

A module that computes through `self.ops` derives from `OpsUser`. Until its model hands it a
backend (`use_ops`, which `CausalLM` does when it is built) it uses the device's, made once
per process: a module built on its own (a test's, a speculative head's) computes as its
device does.
"""

from __future__ import annotations

from functools import cache

import mlx.nn as nn
from mlx.utils import tree_flatten

from kernels_metal.backends import device_ops_name, ops_named
from kernels_metal.ops import Ops, OpsName


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


class OpsModel(nn.Module, OpsUser):
    """A whole model (a causal LM, an encoder): it hands its modules their backend and tells
    the backend when its parameters change. Its ops backend is the device's
    (`kernels_metal.backends.device_ops_name`) unless `use_ops` names another."""

    def use_ops(self, name: OpsName) -> None:
        """Compute with a fresh backend `name` from now on (see kernels_metal.ops)."""
        use_ops(self, ops_named(name))

    def settle(self) -> None:
        """Loaded and warmed up: let the backend place the weights it streams."""
        self.ops.settle([p for _, p in tree_flatten(self.parameters())])

    def update(self, parameters: dict, strict: bool = True) -> OpsModel:
        self.ops.parameters_changed()  # new parameters may be of another dtype
        return super().update(parameters, strict)

    def update_modules(self, modules: dict, strict: bool = True) -> OpsModel:
        self.ops.parameters_changed()  # e.g. quantized layers in place of float ones
        super().update_modules(modules, strict)
        use_ops(self, self.ops)  # new modules compute with the model's backend too
        return self
