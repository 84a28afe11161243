"""The server's layers: server/core owns the chat vocabulary and logic, and the three APIs
(server/openai, server/anthropic, server/responses) are adapters that import core, never
each other. Read from the source with `ast`, so imports inside functions and under
`TYPE_CHECKING` count as much as those at the top of a module."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SERVER = Path(__file__).resolve().parent.parent / "server"
ADAPTERS = ("server.openai", "server.anthropic", "server.responses")


def _module_name(path: Path) -> str:
    parts = path.relative_to(SERVER.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """Every module `source` (the text of `module`) imports, anywhere in it, with its line.
    `from a import b` counts as importing both `a` and `a.b` (b may be a submodule)."""
    package = module if is_package else module.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def _is_within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _violations(package_dir: Path, forbidden: tuple[str, ...]) -> list[str]:
    """`file:line imports name` for each import of a `forbidden` package under `package_dir`."""
    paths = sorted(package_dir.rglob("*.py"))
    assert paths, f"no modules under {package_dir}"
    found: dict[str, str] = {}  # "file:line" -> the first forbidden module it imports
    for path in paths:
        module = _module_name(path)
        imports = imported_modules(path.read_text(), module, path.name == "__init__.py")
        for line, name in imports:
            if any(_is_within(name, package) for package in forbidden):
                found.setdefault(f"{path.relative_to(SERVER.parent)}:{line}", name)
    return [f"{where} imports {name}" for where, name in found.items()]


def test_import_reader_sees_every_kind_of_import() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "import server.openai.protocol\n"
        "from server import anthropic\n"
        "from ..responses import input\n"
        "if TYPE_CHECKING:\n"
        "    from server.openai.serving import Serving\n"
        "def f():\n"
        "    from server.responses.tools import read_tools\n"
    )
    names = {name for _, name in imported_modules(source, "server.core.example")}
    assert {
        "server.openai.protocol", "server.anthropic", "server.responses.input",
        "server.openai.serving", "server.responses.tools",
    } <= names  # fmt: skip


def test_core_imports_no_adapter() -> None:
    found = _violations(SERVER / "core", ADAPTERS)
    assert not found, "server/core must not import an API adapter:\n" + "\n".join(found)


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_adapter_imports_no_other_adapter(adapter: str) -> None:
    others = tuple(a for a in ADAPTERS if a != adapter)
    found = _violations(SERVER / adapter.split(".")[1], others)
    assert not found, f"{adapter} must import core, not another adapter:\n" + "\n".join(found)
