"""The declared dependencies are the true ones: what the library imports is declared, and
every declared runtime dependency is imported (pyproject.toml's ``dependencies`` and extras)."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest

# pyproject.toml is read with the standard library's TOML reader (Python 3.11+).
tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ("dtcompile", "dynamo_vars", "hops", "tools")
OURS = {"dtcompile", "dynamo_vars", "dtcompile_tools", "tools"}


def _requirement_name(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].strip().lower()


def _declared() -> tuple[set[str], dict[str, set[str]]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = {_requirement_name(r) for r in project["dependencies"]}
    extras = {name: {_requirement_name(r) for r in reqs} for name, reqs in project["optional-dependencies"].items()}
    return runtime, extras


def _imported_distributions(folders: tuple[str, ...]) -> dict[str, set[str]]:
    """Distribution -> the library files that import it (top-level module names mapped by
    the installed distributions' metadata)."""
    by_module = importlib.metadata.packages_distributions()
    found: dict[str, set[str]] = {}
    for folder in folders:
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top in OURS or top in sys.stdlib_module_names:
                        continue
                    for dist in by_module.get(top, [top]):
                        found.setdefault(dist.lower(), set()).add(str(path.relative_to(ROOT)))
    return found


def test_what_the_library_imports_is_declared():
    runtime, extras = _declared()
    declared = runtime | set().union(*extras.values())
    imported = _imported_distributions(LIBRARY)
    undeclared = {dist: sorted(files) for dist, files in imported.items() if dist not in declared}
    assert not undeclared, f"imported but not declared in pyproject.toml: {undeclared}"


def test_every_runtime_dependency_is_used():
    runtime, _ = _declared()
    imported = _imported_distributions(LIBRARY)
    unused = sorted(runtime - set(imported))
    assert not unused, f"declared in pyproject.toml's dependencies but imported by no library module: {unused}"


def test_the_check_sees_an_undeclared_import(tmp_path, monkeypatch):
    """The checks above can fail: a module importing a distribution nobody declared is found."""
    (tmp_path / "planted").mkdir()
    (tmp_path / "planted" / "m.py").write_text("import sympy\nfrom yaml import safe_load\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    found = _imported_distributions(("planted",))
    assert "sympy" in found and ("pyyaml" in found or "yaml" in found)
