"""Every `from dhisparse... import name` in the Triton models' model.py resolves in the installed package.

The imports sit inside `initialize` (Triton loads the file in its own stub process), so a module moved between
packages breaks only a started server; this checks them in seconds, without one."""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

MODELS = sorted((Path(__file__).resolve().parents[2] / "model_repository").glob("*/1/model.py"))


@pytest.mark.parametrize("model_py", MODELS, ids=[p.parts[-3] for p in MODELS])
def test_model_imports_resolve(model_py: Path) -> None:
    missing = []
    for node in ast.walk(ast.parse(model_py.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dhisparse"):
            module = importlib.import_module(node.module)
            for alias in node.names:
                if hasattr(module, alias.name):
                    continue
                try:
                    importlib.import_module(f"{node.module}.{alias.name}")
                except ModuleNotFoundError:
                    missing.append(f"{node.module}.{alias.name} (line {node.lineno})")
    assert not missing, f"{model_py}: unresolved imports {missing}"


def test_every_model_is_checked() -> None:
    assert len(MODELS) >= 6
