"""The library's source files by module name, for the tests that read the code (tests/architecture)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PACKAGES = {"dtcompile": "dtcompile", "dynamo_vars": "dynamo_vars", "hops": "dtcompile.hops", "tools": "dtcompile_tools"}
"""Source folder -> installed package name."""
OURS = tuple(PACKAGES.values())


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Module name -> source file, for every module of the library under ``root``."""
    found = {}
    for folder, package in PACKAGES.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = list(path.relative_to(root / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = path
    return found
