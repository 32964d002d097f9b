"""The package's layout holds: K3 is one registered model spec, and the command sits apart
from the library. Read from the source (``ast``), every import counted, type-checking-only
and function-level ones included."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "k3_trainer"


def _imports(path: Path) -> set[str]:
    """The absolute names ``path`` imports (relative imports resolved)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                base = node.module or ""
            else:
                parts = path.relative_to(SRC.parent).with_suffix("").parts[:-1]  # its package
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def _modules() -> dict[str, Path]:
    return {".".join(p.relative_to(SRC.parent).with_suffix("").parts): p
            for p in SRC.rglob("*.py")}


def test_only_the_k3_spec_and_the_planner_name_k3_model():
    """The trainer is model-agnostic; the K3 spec adapts k3_model to it, and the planner
    (``planning/``) counts K3's layers by kind. Nothing else imports k3_model."""
    naming = sorted(name for name, path in _modules().items()
                    if any(i == "k3_model" or i.startswith("k3_model.") for i in _imports(path)))
    assert [n for n in naming if not n.startswith("k3_trainer.planning.")] == [
        "k3_trainer.models.k3"]


def test_the_library_never_imports_the_command():
    """Everything but ``cli/`` is the library (the lm-eval backend and the session
    included), and no module of it imports ``cli/``: the command sits on top, alone."""
    offenders = sorted(
        name
        for name, path in _modules().items()
        if not name.startswith("k3_trainer.cli")
        and any(i == "k3_trainer.cli" or i.startswith("k3_trainer.cli.") for i in _imports(path))
    )
    assert offenders == []


def test_the_layout_check_sees_imports_at_any_depth(tmp_path):
    """The reader above finds a function-level and a TYPE_CHECKING import (so the two
    checks cannot pass by missing them)."""
    module = SRC / "models" / "k3.py"
    assert {"k3_model.hub", "k3_model.expert_parallel"} <= _imports(module)
    distributed = _imports(SRC / "distributed.py")
    assert "k3_trainer.models.ExpertParallel" in distributed  # under TYPE_CHECKING
