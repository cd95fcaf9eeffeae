"""Installing dtcompile changes nobody else's process: imports are inert, Dynamo is changed
only by a backend, the way torch's own registries are changed, and can be changed back.

Each test runs in a fresh interpreter (what is installed into Dynamo is per process).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.subprocess


def run_python(script: str, cwd: Path | None = None, timeout: int = 300) -> str:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out.stdout.strip().splitlines()[-1]


def test_imports_leave_dynamo_untouched():
    last = run_python(
        """
        import torch
        from torch._dynamo.guards import GuardBuilder
        from torch._dynamo.variables.builder import VariableBuilder

        table = dict(VariableBuilder._id_dispatch())
        guards = dict(vars(GuardBuilder))
        import dtcompile, dtcompile.testing, dtcompile.hops, dynamo_vars
        import dtcompile.compiler, dtcompile.passes, dtcompile.report  # modules too, not only the packages
        assert not dynamo_vars.is_installed()
        assert dict(VariableBuilder._id_dispatch()) == table, "the id-dispatch table changed at import"
        assert dict(vars(GuardBuilder)) == guards, "a guard builder changed at import"
        print("untouched")
        """
    )
    assert last == "untouched"


def test_import_dtcompile_imports_nothing_heavy():
    last = run_python(
        """
        import sys
        import dtcompile
        print(sorted(m for m in ("torch", "dtcompile.compiler", "dynamo_vars", "dtcompile.hops") if m in sys.modules))
        """
    )
    assert last == "[]"


def test_hops_and_dynamo_vars_load_the_base_and_no_backend_module():
    """The packages below the backend reach ``dtcompile.base`` only: importing them (and
    everything in them) loads no other module of ``dtcompile``."""
    last = run_python(
        """
        import pkgutil, importlib, sys
        import dtcompile.hops as hops, dynamo_vars
        for package in (hops, dynamo_vars):
            for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
                importlib.import_module(info.name)
        ours = sorted(m for m in sys.modules if m == "dtcompile" or m.startswith("dtcompile."))
        print(len(ours) > 1, [m for m in ours if m != "dtcompile" and m.partition(".")[2].partition(".")[0] not in ("base", "hops")])
        """
    )
    assert last == "True []"


def test_lookup_by_name_installs_and_uninstall_then_lookup_installs_again():
    last = run_python(
        """
        import torch
        import dynamo_vars

        assert not dynamo_vars.is_installed()
        f = torch.compile(lambda x: x * 2, backend="dtcompile")
        first = dynamo_vars.is_installed()
        dynamo_vars.uninstall()
        after_uninstall = dynamo_vars.is_installed()
        g = torch.compile(lambda x: x * 3, backend="dtcompile")
        again = dynamo_vars.is_installed()
        print(first, after_uninstall, again)
        """
    )
    assert last == "True False True"


def test_substitute_in_graph_works_before_during_and_after_install():
    last = run_python(
        """
        import torch
        import dynamo_vars
        import dtcompile

        def untraceable(x):
            torch._dynamo.graph_break()  # fullgraph fails unless the substitute is traced
            return x + 1

        def make(tag):
            def original(x):
                torch._dynamo.graph_break()
                return x + tag
            def polyfill(x):
                return x + tag
            return original, polyfill

        registered = []
        def register(tag):
            original, polyfill = make(tag)
            torch.compiler.substitute_in_graph(original)(polyfill)
            registered.append((tag, original))

        register(1)                               # before install
        backend = dtcompile.backend(inductor=False)
        assert dynamo_vars.is_installed()
        register(2)                               # during
        dynamo_vars.uninstall()
        register(3)                               # after
        dynamo_vars.install()
        x = torch.zeros(2)
        results = []
        for tag, original in registered:
            torch._dynamo.reset()
            out = torch.compile(lambda x: original(x) * 2, backend=backend, fullgraph=True)(x)
            results.append(int(out[0]))
        print(results)
        """
    )
    assert last == "[2, 4, 6]"


def test_a_function_torch_already_handles_is_a_loud_clash():
    last = run_python(
        """
        import torch
        import torch.distributed.tensor as dtensor
        import dynamo_vars
        from dynamo_vars._install import HandlerClashError

        # As if a newer torch handled DTensor's factories itself.
        torch.compiler.substitute_in_graph(dtensor.ones, skip_signature_check=True)(lambda *a, **k: None)
        try:
            dynamo_vars.install()
        except HandlerClashError as e:
            print("clash:", "torch.distributed.tensor.ones" in str(e), dynamo_vars.is_installed())
        """
    )
    assert last == "clash: True False"


def test_on_the_running_torch_a_backend_installs_dynamo_vars_without_a_warning():
    """On every supported release (CI runs this on each), making a backend installs
    dynamo_vars and warns about nothing: no fence, no deprecation of a torch name we use."""
    last = run_python(
        """
        import warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import torch, dtcompile, dynamo_vars
            dtcompile.backend(inductor=False)
        print(dynamo_vars.is_installed(), [str(w.message)[:200] for w in caught])
        """
    )
    assert last == "True []"


def test_below_the_tested_torch_range_dynamo_stays_stock():
    """An older torch than the tested range (a newer one is judged by the contract:
    tests/architecture/test_newer_torch.py)."""
    last = run_python(
        """
        import warnings
        import torch
        torch.__version__ = "2.12.0"   # as an older torch would report
        import dynamo_vars
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ok = dynamo_vars.install()
            dynamo_vars.install()
        print(ok, dynamo_vars.is_installed(), len(caught), "outside the tested range" in str(caught[0].message))
        """
    )
    assert last == "False False 1 True"


def test_pytest_in_an_unrelated_project_does_not_import_dtcompile(tmp_path):
    (tmp_path / "test_unrelated.py").write_text(
        textwrap.dedent(
            """
            import sys

            def test_one():
                assert 1 + 1 == 2
                heavy = sorted(m for m in ("dtcompile", "torch", "dynamo_vars", "dtcompile.hops") if m in sys.modules)
                with open("modules.txt", "w") as f:
                    f.write(repr(heavy))
            """
        )
    )
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_unrelated.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    plugins = subprocess.run(
        [sys.executable, "-c", "import importlib.metadata as m; print(sorted(e.value for e in m.entry_points(group='pytest11')))"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    assert "dtcompile_tools.pytest_plugin" in plugins  # the plugin was there to be loaded
    assert (tmp_path / "modules.txt").read_text() == "[]"
