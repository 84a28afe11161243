"""The backend seam: model code computes through its ops (kernels_metal.ops) and never asks
which backend runs, and the reference corner of the kernels is pure MLX. Read from the
sources, so a new import or device test anywhere in them fails here."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The text models and the vision towers (which compute on the text model's backend).
MODEL_FILES = sorted([*(ROOT / "metal_engine" / "models").glob("*.py"),
                      *(ROOT / "metal_engine" / "vision").glob("*.py")])
# Modules that are the CPU host backend (its subpackage, and its loops until they all move).
HOST_BACKEND = ("kernels_metal.cpu", "kernels_metal.cpu_")
# Names whose use asks which backend runs.
BACKEND_TESTS = {"on_cpu", "numpy_serves", "default_device", "is_available", "array_module"}


def imported_modules(tree: ast.AST) -> list[str]:
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    return names


def backend_tests(tree: ast.AST) -> list[str]:
    """Each place that tests the backend: a backend-testing name, or `isinstance(x, ...)`
    against numpy's array type."""
    found = []
    for node in ast.walk(tree):
        name = node.id if isinstance(node, ast.Name) else (
            node.attr if isinstance(node, ast.Attribute) else None)
        if name in BACKEND_TESTS:
            found.append(f"line {node.lineno}: {name}")
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id == "isinstance" and "ndarray" in ast.unparse(node.args[1])):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


@pytest.mark.parametrize("path", MODEL_FILES, ids=lambda p: p.name)
def test_model_code_neither_imports_the_host_backend_nor_tests_the_backend(path):
    tree = ast.parse(path.read_text())
    host_imports = [m for m in imported_modules(tree) if m.startswith(HOST_BACKEND)]
    assert not host_imports, f"{path.name} imports the CPU host backend: {host_imports}"
    assert not backend_tests(tree), f"{path.name} tests the backend: {backend_tests(tree)}"


# The engine's build decides the backend once; the loop and the runner never ask. Each
# file's calls of device_ops_name:
SERVING_FILES = {"runner.py": 0, "engine.py": 0, "engine_build.py": 1}


def device_ops_name_calls(tree: ast.AST) -> int:
    return sum(isinstance(node, ast.Call) and ast.unparse(node.func).endswith("device_ops_name")
               for node in ast.walk(tree))


@pytest.mark.parametrize(("name", "decisions"), SERVING_FILES.items())
def test_the_engine_and_runner_choose_the_backend_once_and_never_test_it(name, decisions):
    tree = ast.parse((ROOT / "metal_engine" / name).read_text())
    host_imports = [m for m in imported_modules(tree) if m.startswith(HOST_BACKEND)]
    assert not host_imports, f"{name} imports the CPU host backend: {host_imports}"
    assert not backend_tests(tree), f"{name} tests the backend: {backend_tests(tree)}"
    assert device_ops_name_calls(tree) <= decisions, f"{name} asks for the device's backend"


@pytest.mark.parametrize("name", ["reference.py", "fast_rope.py"])
def test_the_reference_is_pure_mlx(name):
    tree = ast.parse((ROOT / "kernels_metal" / name).read_text())
    host_imports = [m for m in imported_modules(tree) if m.startswith(HOST_BACKEND)]
    assert not host_imports and not backend_tests(tree)


def test_the_check_finds_what_it_looks_for():
    """A module that does both is caught (the checks above would pass on anything otherwise)."""
    tree = ast.parse("from kernels_metal.cpu_math import on_cpu\n"
                     "import numpy as np\n"
                     "def f(x):\n"
                     "    return on_cpu() or isinstance(x, np.ndarray)\n")
    assert [m for m in imported_modules(tree) if m.startswith(HOST_BACKEND)]
    assert len(backend_tests(tree)) == 2  # the call of on_cpu, the isinstance
    tree = ast.parse("if cpu_math.on_cpu() or mx.metal.is_available():\n"
                     "    name = device_ops_name()\n")
    assert len(backend_tests(tree)) == 2 and device_ops_name_calls(tree) == 1
