"""docs/architecture.md is kept true: every path and code symbol it names still exists.

Checked, for each backticked name in the page: a path (relative to the repository or to ``backend/dhisparse/``) exists;
a class (``KVManager``) is defined in the code, and ``Class.member`` names a method or attribute of that class (or of
a class it names in its body, for protocols); a snake_case name with an underscore (``make_kv_store``) is defined or
used somewhere in the code or the model repository."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "backend" / "dhisparse"
DOC = ROOT / "docs" / "architecture.md"
CODE_DIRS = ("backend", "engine_builder", "client", "model_repository", "plugins")


@cache
def _code() -> str:
    parts = []
    for folder in CODE_DIRS:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix in (".py", ".pbtxt", ".h", ".cpp", ".cu") and "__pycache__" not in path.parts:
                parts.append(path.read_text(errors="replace"))
    return "\n".join(parts)


def _names() -> list[str]:
    text = DOC.read_text()
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # the overview diagram is prose
    return re.findall(r"`([^`\n]+)`", text)


def _is_path(name: str) -> bool:
    """A repository path: a folder or file below the root (an engine directory's files, URL paths and build outputs
    such as ``libdhisparse_cpu.so`` are not)."""
    return ("/" in name and not name.startswith("/")) or re.search(r"\.(py|md|h)$", name) is not None


def _class_body(name: str) -> str | None:
    match = re.search(rf"^class {re.escape(name)}\b.*?(?=^class |\Z)", _code(), flags=re.S | re.M)
    return match.group(0) if match else None


def test_the_page_names_enough_to_be_checked() -> None:
    names = _names()
    assert sum(_is_path(n) for n in names) >= 30 and sum(bool(re.match(r"[A-Z]\w+", n)) for n in names) >= 30


def test_every_path_named_exists() -> None:
    missing = []
    for name in _names():
        if not _is_path(name) or name.startswith("../") or "<" in name or " " in name or name.startswith("http"):
            continue
        if not any((base / name).exists() for base in (ROOT, PACKAGE, DOC.parent)):
            missing.append(name)
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"


def test_every_class_and_member_named_exists() -> None:
    missing = []
    for name in _names():
        match = re.fullmatch(r"([A-Z][A-Za-z0-9]+)(?:\.([a-z_][a-z0-9_]*))?", name)
        if match is None:
            continue
        cls, member = match.groups()
        body = _class_body(cls)
        if body is None:
            if member is not None or not re.search(rf"\b{cls}\b", _code()):  # a C++ or external class: named there
                missing.append(name)
        elif member is not None and not re.search(rf"(def {member}\b|\b{member}\s*[:=])", body):
            missing.append(name)
    assert not missing, f"docs/architecture.md names classes or members that do not exist: {missing}"


def test_every_function_named_exists() -> None:
    missing = [name for name in _names()
               if re.fullmatch(r"[a-z][a-z0-9]*(_[a-z0-9]+)+", name) and not re.search(rf"\b{name}\b", _code())]
    assert not missing, f"docs/architecture.md names functions or fields the code no longer has: {missing}"
