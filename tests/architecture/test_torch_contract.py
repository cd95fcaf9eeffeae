"""Every private torch name dtcompile relies on still exists, with the parameters it is called with.

An upgrade of torch that moves or changes one fails here, in one readable line
per name, instead of somewhere deep (a guard that no longer explains itself, a
region whose backward is paired wrongly).  The list is
:data:`dtcompile.torch_contract.PRIVATE_NAMES`.
"""

from __future__ import annotations

import importlib
import inspect

import pytest

from dtcompile.torch_contract import PRIVATE_NAMES, TESTED_TORCH, torch_is_supported


def _resolve(module: str, path: str):
    obj = importlib.import_module(module)
    for part in path.split("."):
        obj = inspect.getattr_static(obj, part) if isinstance(obj, type) else getattr(obj, part)
    if isinstance(obj, (classmethod, staticmethod)):
        obj = obj.__func__
    return getattr(obj, "__wrapped__", obj)


@pytest.mark.parametrize("module, path, params", PRIVATE_NAMES, ids=[f"{m}.{p}" for m, p, _ in PRIVATE_NAMES])
def test_private_name_exists_with_its_signature(module, path, params):
    try:
        obj = _resolve(module, path)
    except (ImportError, AttributeError) as e:
        pytest.fail(f"torch no longer has {module}.{path} ({e}); dtcompile relies on it")
    if params is None:
        return
    names = list(inspect.signature(obj).parameters)
    missing = [p for p in params if p not in names]
    assert not missing, f"{module}.{path}{inspect.signature(obj)} lost the parameters {missing} dtcompile passes"


def test_the_running_torch_is_the_tested_one():
    import torch

    assert torch_is_supported(), f"torch {torch.__version__} is outside {TESTED_TORCH}"


@pytest.mark.parametrize(
    "version, supported",
    [("2.13.0", True), ("2.13.0+cpu", True), ("2.13.1", True), ("2.12.9", False), ("2.14.0", False), ("2.9.0", False)],
)
def test_the_version_fence_compares_versions_not_strings(version, supported):
    # "2.9.0" > "2.13.0" as strings: a string comparison would let it in.
    assert torch_is_supported(version) is supported
