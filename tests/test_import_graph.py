"""No package has an import cycle, counting imports made only for type checking: a module
that needs another one's names at import time, or for its annotations, sits above it.

The graph is read from the source (``ast``), so nothing is imported: an edge is any
``import``/``from … import`` of a module of the same package, at any depth of the file
(``if TYPE_CHECKING:`` blocks and function bodies included). Importing a package means
running its ``__init__``: ``from .observe import x`` is an edge to ``observe``'s
``__init__`` when ``x`` is a name it defines, and to the submodule when ``x`` is one.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _modules(src: Path) -> dict[str, Path]:
    """``{dotted name: file}`` of every module of the package under ``src``."""
    found = {}
    for path in src.rglob("*.py"):
        parts = list(path.relative_to(src.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _resolve(module: str, is_package: bool, level: int, name: str | None) -> str:
    base = module.split(".") if is_package else module.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join([*base, *([name] if name else [])])


def import_graph(src: Path) -> dict[str, set[str]]:
    """``{module: modules of the same package it imports}``."""
    modules = _modules(src)
    top = src.name
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = (node.module or "") if node.level == 0 else _resolve(
                    name, is_package, node.level, node.module)
                submodules = [f"{base}.{alias.name}" for alias in node.names]
                # ``from pkg import mod`` needs pkg only as far as the import system does;
                # a name defined in pkg's __init__ needs pkg itself.
                names_in_base = any(sub not in modules for sub in submodules)
                targets = [*([base] if names_in_base else []), *submodules]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]  # a name inside a module
                if target and target.split(".")[0] == top and target != name:
                    graph[name].add(target)
                    parent = target.rpartition(".")[0]
                    while parent:  # importing a.b.c runs a/__init__ and a/b/__init__
                        if parent != name and parent in modules and not name.startswith(
                                parent + "."):
                            graph[name].add(parent)
                        parent = parent.rpartition(".")[0]
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_package_has_an_import_cycle():
    for src in sorted((ROOT / "packages").glob("*/src/*")):
        if src.is_dir():
            assert cycles(import_graph(src)) == [], src.name


def test_the_checker_sees_a_cycle_through_a_type_checking_import(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from .b import B\n")
    (package / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import A\nB = 1\n")
    assert cycles(import_graph(package)) == [["pkg.a", "pkg.b"]]
    (package / "b.py").write_text("B = 1\n")
    assert cycles(import_graph(package)) == []


def private_imports(src: Path) -> list[str]:
    """``module: name`` for every underscore name a module imports from another module of
    its own package: modules meet through names meant to be imported, never another's
    private helpers (dunder names such as ``__version__`` are public)."""
    found = []
    for name, path in sorted(_modules(src).items()):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (
                    node.level > 0 or (node.module or "").split(".")[0] == src.name):
                found += [f"{name}: {alias.name}" for alias in node.names
                          if alias.name.startswith("_") and not alias.name.startswith("__")]
    return found


def test_no_module_imports_a_private_name_of_its_package():
    for src in sorted((ROOT / "packages").glob("*/src/*")):
        if src.is_dir():
            assert private_imports(src) == [], src.name


def test_the_private_import_check_sees_relative_and_absolute_imports(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("__version__ = '1'\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("def _helper(): ...\ndef helper(): ...\n")
    (package / "sub" / "b.py").write_text("from ..a import helper\nfrom pkg import __version__\n")
    assert private_imports(package) == []
    (package / "sub" / "b.py").write_text("def f():\n    from ..a import _helper\n")
    assert private_imports(package) == ["pkg.sub.b: _helper"]
    (package / "sub" / "b.py").write_text("from pkg.a import _helper\n")
    assert private_imports(package) == ["pkg.sub.b: _helper"]
