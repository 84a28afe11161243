"""The import structure: no module imports, even indirectly, one that imports it; the scheduler
is pure Python.

Every import counts (module level, inside functions, under TYPE_CHECKING): a loop that only a
type annotation closes still ties two modules into one concern.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("metal_engine", "kernels_metal", "scheduler", "server", "convert")
NOT_IN_SCHEDULER = ("mlx", "numpy")


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the packages."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imported_names(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    """Every dotted name `tree` imports, relative imports resolved (`from a import b`: a.b,
    which is module a's attribute b where a.b is no module)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".")[: len(module.split(".")) - node.level + is_package]
                base = ".".join([*package, base] if base else package)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules of the packages it imports (a name `from a.b import c` names
    module `a.b.c` if there is one, else `a.b`)."""
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        targets = set()
        for imported in imported_names(tree, name, path.name == "__init__.py"):
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                targets.add(imported)
        graph[name] = targets
    return graph


def loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import loops: each group of modules that reach one another (Tarjan's algorithm),
    of two modules or more."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def package_imports(names: set[str], packages: tuple[str, ...]) -> set[str]:
    return {n for n in names if n.split(".")[0] in packages}


def test_no_module_imports_one_that_imports_it():
    assert loops(import_graph(module_files())) == []


@pytest.mark.parametrize("path", sorted((ROOT / "scheduler").rglob("*.py")),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_the_scheduler_imports_neither_mlx_nor_numpy(path):
    name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    names = imported_names(ast.parse(path.read_text()), name, path.name == "__init__.py")
    assert not package_imports(names, NOT_IN_SCHEDULER)


def test_the_runner_takes_the_step_contract_and_no_scheduler_state():
    """The runner builds what it samples from (token histories included) out of what the
    step contract carries: it imports scheduler.output and nothing else of the scheduler."""
    path = ROOT / "metal_engine" / "runner.py"
    names = imported_names(ast.parse(path.read_text()), "metal_engine.runner", False)
    assert {n.rpartition(".")[0] for n in package_imports(names, ("scheduler",))} == {
        "scheduler.output"}


def test_the_checks_find_what_they_look_for(tmp_path):
    """A loop closed by a function-level import and one closed under TYPE_CHECKING are both
    found; a relative import resolves; numpy is seen in any form."""
    files = {
        "metal_engine/__init__.py": "",
        "metal_engine/a.py": "from metal_engine.b import f\n",
        "metal_engine/b.py": "def f():\n    from metal_engine import a\n",
        "metal_engine/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                             "    from .d import D\n",
        "metal_engine/d.py": "from metal_engine.c import C\n",
        "metal_engine/e.py": "from metal_engine import a\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    found = loops(import_graph(module_files(tmp_path)))
    assert found == [["metal_engine.a", "metal_engine.b"], ["metal_engine.c", "metal_engine.d"]]
    tree = ast.parse("import numpy as np\ndef f():\n    from mlx import core\n")
    assert package_imports(imported_names(tree, "scheduler.x", False),
                           NOT_IN_SCHEDULER) == {"numpy", "mlx.core"}
