"""What ``pip install`` puts in place: the import names, the entry points, the console script."""

from __future__ import annotations

import collections
import importlib.metadata
import os
from pathlib import Path

import pytest

import dtcompile

ROOT = Path(__file__).resolve().parents[2]


def test_the_distribution_installs_no_package_called_tools():
    files = importlib.metadata.files("dtcompile") or []
    top = {f.parts[0] for f in files if f.suffix == ".py"}
    assert "tools" not in top
    if not any(name.startswith("__editable__") for name in top):  # an editable install lists only its finder
        assert {"dtcompile", "dynamo_vars", "hops", "dtcompile_tools"} <= top


def test_entry_points_and_script_name_our_modules():
    eps = importlib.metadata.entry_points()
    assert {e.value for e in eps.select(group="torch_dynamo_backends", name="dtcompile")} == {"dtcompile.registry:dtcompile"}
    assert {e.value for e in eps.select(group="pytest11", name="dtcompile")} == {"dtcompile_tools.pytest_plugin"}
    assert {e.value for e in eps.select(group="console_scripts", name="dtcompile-report")} == {"dtcompile_tools.report:main"}


@pytest.mark.skipif(os.environ.get("DTCOMPILE_TEST_INSTALLED") != "1", reason="CI sets DTCOMPILE_TEST_INSTALLED=1 after a non-editable install")
def test_ci_tests_the_installed_wheel_not_the_source_tree():
    path = Path(dtcompile.__file__).resolve()
    assert path.parent != ROOT / "dtcompile" and "site-packages" in path.parts, (
        f"dtcompile was imported from the source tree ({path}), not from the installed wheel"
    )
    import dtcompile_tools

    assert "site-packages" in Path(dtcompile_tools.__file__).resolve().parts


def test_test_file_names_are_unique():
    """Test folders are not packages: pytest imports each test file by its basename, and a
    second file of the same name stops the whole run at collection ("import file mismatch")."""
    names = collections.Counter(path.name for folder in ("tests", "examples") for path in (ROOT / folder).rglob("test_*.py"))
    assert [name for name, count in names.items() if count > 1] == []


def test_every_package_folder_is_one_the_wheel_installs():
    """``[tool.setuptools] packages`` names each package: a folder left out is missing
    from the wheel (an ImportError on users' machines only, not in an editable checkout)."""
    tomllib = pytest.importorskip("tomllib", reason="Python 3.10 has no tomllib")
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {"dtcompile_tools" if init.parent.name == "tools" else ".".join(init.parent.relative_to(ROOT).parts)
               for top in ("dtcompile", "dynamo_vars", "hops", "tools") for init in (ROOT / top).rglob("__init__.py")}
    assert folders == listed
