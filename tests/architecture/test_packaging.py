"""What ``pip install`` puts in place: the import names, the entry points, the console script."""

from __future__ import annotations

import collections
import importlib.metadata
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import dtcompile

ROOT = Path(__file__).resolve().parents[2]


def test_the_distribution_installs_no_package_called_tools():
    files = importlib.metadata.files("dtcompile") or []
    top = {f.parts[0] for f in files if f.suffix == ".py"}
    assert "tools" not in top
    if not any(name.startswith("__editable__") for name in top):  # an editable install lists only its finder
        assert {"dtcompile", "dynamo_vars", "dtcompile_tools"} <= top
        assert "hops" not in top  # installed as dtcompile.hops


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
    installed_as = {"tools": "dtcompile_tools", "hops": "dtcompile.hops"}
    folders = {".".join([installed_as.get(init.parent.relative_to(ROOT).parts[0], init.parent.relative_to(ROOT).parts[0]),
                         *init.parent.relative_to(ROOT).parts[1:]])
               for top in ("dtcompile", "dynamo_vars", "hops", "tools") for init in (ROOT / top).rglob("__init__.py")}
    assert folders == listed


@pytest.mark.subprocess
def test_another_distributions_hops_package_and_dtcompile_work_together(tmp_path):
    """PyPI has an unrelated ``hops`` (Hopsworks' client): dtcompile installs its region op as
    ``dtcompile.hops``, so both import, in either order, each as itself."""
    other = tmp_path / "site" / "hops"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text("WHOSE = 'hopsworks'\n")
    script = textwrap.dedent(
        """
        import sys
        import {first}
        import {second}
        import hops
        import dtcompile
        import dtcompile.hops
        from dtcompile.hops.region_op import local_map_region

        assert hops.WHOSE == "hopsworks", hops.__file__
        assert dtcompile.local_map is dtcompile.hops.local_map, dtcompile.local_map
        assert dtcompile.hops.local_map_region is local_map_region
        assert sys.modules["hops"] is hops and not hasattr(dtcompile.hops, "WHOSE")
        print("both")
        """
    )
    for first, second in (("hops", "dtcompile.hops"), ("dtcompile.hops", "hops")):
        out = subprocess.run(
            [sys.executable, "-c", script.format(first=first, second=second)],
            capture_output=True, text=True, timeout=300, cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(tmp_path / "site")},
        )
        assert out.returncode == 0 and out.stdout.split()[-1:] == ["both"], out.stderr[-3000:]


def path_changes(source: str) -> list[int]:
    """Lines of ``source`` that change ``sys.path`` (a call on it, or an assignment to it)."""
    import ast

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            if isinstance(owner, ast.Attribute) and owner.attr == "path" and getattr(owner.value, "id", "") == "sys":
                found.append(node.lineno)
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any("sys.path" in ast.unparse(t) for t in targets):
                found.append(node.lineno)
    return sorted(found)


def test_tests_share_helpers_through_the_support_package_not_sys_path():
    """Shared test helpers live in ``tests/support`` (imported as ``support.<module>``: pytest
    puts ``tests/`` on the path for ``tests/conftest.py``); no test changes ``sys.path``."""
    found = [f"{path.relative_to(ROOT)}:{line}" for path in sorted((ROOT / "tests").rglob("*.py"))
             for line in path_changes(path.read_text())]
    assert found == [], f"these change sys.path; move the shared helper into tests/support: {found}"
    planted = "import sys\nsys.path.insert(0, 'x')\nsys.path[:0] = ['y']\nsys.path += ['z']\nprint(sys.path)\n"
    assert path_changes(planted) == [2, 3, 4]
