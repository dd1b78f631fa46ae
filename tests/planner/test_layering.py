"""The planner is a package of its own that depends on the runtime, never the reverse, and does not build engines
(issue 31): nothing under backend/dhisparse imports dhisparse_planner, and of the project's packages the planner
imports only the runtime (never the builder or the client)."""

from __future__ import annotations

import ast
from pathlib import Path

BACKEND = Path(__file__).resolve().parents[2] / "backend"


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module.split(".")[0])
    return out


def test_the_runtime_never_imports_the_planner() -> None:
    offenders = [str(p.relative_to(BACKEND)) for p in (BACKEND / "dhisparse").rglob("*.py")
                 if "dhisparse_planner" in _imports(p)]
    assert offenders == []


def test_the_planner_imports_the_runtime_but_not_the_builder() -> None:
    for path in (BACKEND / "dhisparse_planner").rglob("*.py"):
        found = _imports(path)
        assert "dhisparse_builder" not in found, path
        foreign = {m for m in found if m.startswith("dhisparse") and m not in ("dhisparse", "dhisparse_planner")}
        assert not foreign, (path, foreign)
