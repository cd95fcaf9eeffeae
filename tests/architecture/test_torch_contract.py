"""Every private torch name dtcompile relies on is listed, and exists on the running torch.

An upgrade of torch that moves or changes one fails here, in one readable line
per name, instead of somewhere deep (a guard that no longer explains itself, a
region whose backward is paired wrongly).  The list is
:data:`dtcompile.base.torch_contract.PRIVATE_NAMES`; names that exist on some
supported releases only say which (``versions``), and
:mod:`dtcompile.base.torch_compat` picks between them.  The list is complete:
:func:`test_every_private_torch_name_in_the_code_is_in_the_contract` reads the
code and fails on a private name it does not list.  Every torch object that
dynamo_vars or the backend replaces is listed in ``PATCHED`` and is restored by
``dynamo_vars.uninstall()``.  Each name is checked with the contract's own
:func:`~dtcompile.base.torch_contract.problem`, the check
``dynamo_vars.install()`` runs on a torch newer than the tested range
(``tests/architecture/test_newer_torch.py``).
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from dtcompile.base.torch_compat import torch_version
from dtcompile.base.torch_contract import (
    PATCHED,
    PRIVATE_NAMES,
    TESTED_TORCH,
    applies,
    contract_breaks,
    own_attribute,
    problem,
    resolve,
    torch_is_newer,
    torch_is_supported,
)

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("dtcompile", "dynamo_vars", "hops", "tools")


@pytest.mark.parametrize("name", PRIVATE_NAMES, ids=lambda n: n.dotted)
def test_private_name_exists_with_its_signature(name):
    if not applies(name):
        with pytest.raises((ImportError, AttributeError)):
            resolve(name)
        return
    found = problem(name)
    assert found is None, f"torch {name.dotted}: {found}; dtcompile relies on it"


def test_the_whole_contract_holds_as_install_checks_it_on_a_newer_torch():
    """The check ``dynamo_vars.install()`` runs on a torch past the tested range, run here."""
    assert contract_breaks() == []


def test_the_contract_says_which_names_differ_between_releases():
    """Per release, the names only some releases have: the compat layer's cases."""
    differing = {}
    for name in PRIVATE_NAMES:
        if name.versions is not None:
            differing.setdefault(name.versions, []).append(f"{name.module}.{name.path}")
    assert differing == {
        ((2, 13), (2, 14)): [
            "torch._dynamo.variables.script_object.TorchScriptObjectVariable.call_method",
            "torch._dynamo.variables.base.VariableTracker.var_getattr",
        ],
        ((2, 14), (2, 16)): [
            "torch._dynamo.variables.script_object.CustomClassObjectVariable.call_method",
            "torch._dynamo.variables.base.VariableTracker.tp_getattro_impl",
            "torch._dynamo.exc.FakeTensorObservedException",
        ],
        ((2, 15), (2, 16)): ["torch._dynamo.utils.deferred_full_gc"],
    }, differing
    missing_here = [n for n in PRIVATE_NAMES if not applies(n)]
    expected = {(2, 13): 4, (2, 14): 3}.get(torch_version(), 2)
    assert len(missing_here) == expected, (torch_version(), missing_here)


def test_the_running_torch_is_the_tested_one():
    import torch

    assert torch_is_supported(), f"torch {torch.__version__} is outside {TESTED_TORCH}"


@pytest.mark.parametrize(
    "version, supported",
    [
        ("2.13.0", True),
        ("2.13.0+cpu", True),
        ("2.13.1", True),
        ("2.14.1+cu130", True),
        ("2.15.0", True),
        ("2.15.0+cu132", True),
        ("2.12.9", False),
        ("2.16.0", False),
        ("2.9.0", False),
    ],
)
def test_the_version_fence_compares_versions_not_strings(version, supported):
    # "2.9.0" > "2.13.0" as strings: a string comparison would let it in.
    assert torch_is_supported(version) is supported


@pytest.mark.parametrize(
    "version, newer",
    [("2.15.0+cu132", False), ("2.16.0", True), ("2.16.0+cu130", True), ("2.17.1", True), ("2.12.9", False), ("2.9.0", False)],
)
def test_a_newer_torch_is_told_from_an_older_one(version, newer):
    assert torch_is_newer(version) is newer


def test_a_newer_torch_is_expected_to_have_the_newest_tested_releases_names():
    newest_only = [n.dotted for n in PRIVATE_NAMES if not applies(n, (2, 13))]
    assert [n.dotted for n in PRIVATE_NAMES if not applies(n, (2, 16))] == [
        "torch._dynamo.variables.script_object.TorchScriptObjectVariable.call_method",
        "torch._dynamo.variables.base.VariableTracker.var_getattr",
    ]
    assert all(applies(n, (2, 17)) for n in PRIVATE_NAMES if n.dotted in newest_only), newest_only
    assert not any(applies(n, (2, 12)) for n in PRIVATE_NAMES if n.versions is not None)


# ---- the contract is complete


def _is_private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def private_torch_references(path: Path) -> set[str]:
    """Every dotted torch name ``path`` uses that has a private part (``torch._dynamo.utils.counters``).

    Names come from ``from torch... import`` statements, ``import torch...``, and
    attribute chains rooted at a name bound to a torch module or object by an
    import anywhere in the file (inside functions too).
    """
    tree = ast.parse(path.read_text())
    bound: dict[str, str] = {}
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    bound[alias.asname or "torch"] = alias.name if alias.asname else "torch"
                    found.add(alias.name)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
            for alias in node.names:
                bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                found.add(f"{node.module}.{alias.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            parts = []
            inner = node
            while isinstance(inner, ast.Attribute):
                parts.append(inner.attr)
                inner = inner.value
            if isinstance(inner, ast.Name) and inner.id in bound:
                found.add(".".join([bound[inner.id], *reversed(parts)]))
    private = set()
    for name in found:
        parts = name.split(".")
        while parts[-1].startswith("__"):  # GuardBuilder.__dict__: the object's own dunders
            parts.pop()
        if any(_is_private(part) for part in parts):
            private.add(".".join(parts))
    return private


def _covered(reference: str, listed: set[str]) -> bool:
    """A listed name, something it owns (``.cache_clear``), or a module or class holding one."""
    return any(
        reference == name or reference.startswith(name + ".") or name.startswith(reference + ".") for name in listed
    )


def test_every_private_torch_name_in_the_code_is_in_the_contract():
    listed = {f"{n.module}.{n.path}" for n in PRIVATE_NAMES}
    missing = {}
    for folder in SOURCES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for reference in private_torch_references(path):
                if not _covered(reference, listed):
                    missing.setdefault(reference, str(path.relative_to(ROOT)))
    assert not missing, "private torch names used but not in PRIVATE_NAMES:\n" + "\n".join(
        f"  {name}  ({where})" for name, where in sorted(missing.items())
    )


def test_the_scan_finds_a_private_name_however_it_is_imported(tmp_path):
    """The completeness test must be able to fail: each way of naming one is found."""
    source = tmp_path / "sample.py"
    source.write_text(
        "import torch\n"
        "import torch._dynamo.config as dynamo_config\n"
        "from torch._dynamo.utils import counters\n"
        "from torch.distributed.tensor import DTensor\n"
        "def f():\n"
        "    from torch._inductor import config\n"
        "    return torch._C._get_thing(), dynamo_config.x, counters, DTensor._op_dispatcher, config.y\n"
    )
    assert private_torch_references(source) == {
        "torch._C",
        "torch._dynamo.config",
        "torch._dynamo.config.x",
        "torch._dynamo.utils.counters",
        "torch._C._get_thing",
        "torch.distributed.tensor.DTensor._op_dispatcher",
        "torch._inductor.config",
        "torch._inductor.config.y",
    }
    assert not _covered("torch._C._get_thing", {"torch._C._other"})
    assert _covered("torch._C", {"torch._C._other"})


# ---- patches: each listed, each undone


def _patched_by_the_code() -> set[tuple[str, str]]:
    from dynamo_vars._install import _families

    found = set()
    for family in _families():
        for name in getattr(family, "GUARD_BUILDERS", {}):
            found.add(("torch._dynamo.guards", f"GuardBuilder.{name}"))
        for owner, name in getattr(family, "WRAPPED", dict)():
            module = owner.__name__ if inspect.ismodule(owner) else owner.__module__
            path = name if inspect.ismodule(owner) else f"{owner.__qualname__}.{name}"
            found.add((module, path))
    return found


def _patched() -> set[tuple[str, str]]:
    return {(n.module, n.path) for n in PATCHED if applies(n)}


def test_every_patch_of_a_torch_object_is_listed():
    assert _patched_by_the_code() == _patched()


def test_every_patch_is_in_the_contract():
    listed = {(n.module, n.path) for n in PRIVATE_NAMES if applies(n)}
    assert _patched() - listed == set()


def test_uninstall_restores_every_patched_object():
    import dynamo_vars

    def current():
        return {(n.module, n.path): own_attribute(n) for n in PATCHED if applies(n)}

    with dynamo_vars.enabled(False):
        before = current()
        with dynamo_vars.enabled(True):
            during = current()
        after = current()
    assert all(during[k] is not before[k] for k in before), [k for k in before if during[k] is before[k]]
    assert all(after[k] is before[k] for k in before), [k for k in before if after[k] is not before[k]]
