"""A torch newer than the tested range is judged by the contract, not by its version.

``pyproject.toml`` declares a lower bound only, so that installing dtcompile never
replaces the torch a user installed first; ``dynamo_vars.install()`` then checks the
contract (:func:`dtcompile.base.torch_contract.contract_breaks`) once on a torch past
:data:`~dtcompile.base.torch_contract.TESTED_TORCH`: it installs where the contract
holds, with one log line, and stays off with one warning naming what broke otherwise.
An older torch stays off by its version.  :func:`~dtcompile.base.torch_contract.require`
is the same check at a feature's entry, raising: ``dtcompile.auto_parallel``'s ``plan``
and the passes' ``run_passes`` each check their one tuple of names (``_TORCH_NAMES``),
which the contract test's scanner of the code keeps complete.

The newer torch is a stand-in: the running torch reporting ``2.16.0``, with a name
taken away where the contract must break.  Each test leaves dynamo_vars installed or
not as it found it, and ``require``'s kept answers as it found them (the
``stand_in_torch`` fixture).
"""

from __future__ import annotations

import logging
import re
import shlex
import warnings
from pathlib import Path

import pytest
from expecttest import assert_expected_inline
from packaging.requirements import Requirement
from test_torch_contract import _covered, private_torch_references

from dtcompile.base import torch_contract
from dtcompile.base.torch_compat import torch_version
from dtcompile.base.torch_contract import (
    PRIVATE_NAMES,
    TESTED_TORCH,
    Break,
    TorchContractError,
    describe,
    last_tested,
    require,
)

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest itself depends on tomli there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
LOGGER = "dynamo_vars._install"


# The stand-in newer torch is the running torch with its version raised; the contract of a newer
# torch is the newest tested release's names, so only that release can stand in for one that keeps it.
_ON_THE_NEWEST_TESTED = pytest.mark.skipif(
    torch_version() != last_tested(),
    reason="the stand-in newer torch is the newest tested release with its version raised",
)


@pytest.fixture
def stand_in_torch(monkeypatch):
    """Sets the version the running torch reports; dynamo_vars starts uninstalled with a
    fresh fence (no contract checked, no warning given) and ends installed or not as found;
    ``require`` keeps no answer from before (nor from before the version was set)."""
    import torch
    from torch.torch_version import TorchVersion

    import dynamo_vars
    from dynamo_vars import _install

    was_installed = dynamo_vars.is_installed()
    dynamo_vars.uninstall()
    monkeypatch.setattr(_install, "_newer_breaks", None)
    monkeypatch.setattr(_install, "_warned_version", False)
    monkeypatch.setattr(torch_contract, "_required", {})

    def report(version: str) -> None:
        monkeypatch.setattr(torch, "__version__", TorchVersion(version))
        monkeypatch.setattr(torch_contract, "_required", {})

    try:
        yield report
    finally:
        dynamo_vars.uninstall()
        monkeypatch.undo()  # the version and any name taken away, before installing again
        if was_installed:
            dynamo_vars.install()
        assert dynamo_vars.is_installed() == was_installed


def _install_recorded():
    """``dynamo_vars.install()``: whether it installed, the warnings it gave."""
    import dynamo_vars

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        installed = dynamo_vars.install()
    assert installed == dynamo_vars.is_installed()
    return installed, [str(w.message) for w in caught]


def _counting_checks(monkeypatch) -> list[None]:
    """Counts the contract's checks: one entry per call of ``contract_breaks``."""
    calls: list[None] = []
    check = torch_contract.contract_breaks
    monkeypatch.setattr(torch_contract, "contract_breaks", lambda: calls.append(None) or check())
    return calls


@_ON_THE_NEWEST_TESTED
def test_a_newer_torch_that_keeps_the_contract_gets_dynamo_vars_with_one_log_line(stand_in_torch, monkeypatch, caplog):
    import dynamo_vars

    stand_in_torch("2.16.0")
    checks = _counting_checks(monkeypatch)
    caplog.set_level(logging.INFO, logger=LOGGER)
    assert _install_recorded() == (True, [])
    dynamo_vars.uninstall()
    assert _install_recorded() == (True, [])  # installed again: the contract is not checked again
    assert len(checks) == 1
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert [r.levelno for r in caplog.records if r.name == LOGGER] == [logging.INFO]
    assert_expected_inline(lines[0], """\
dtcompile: torch 2.16.0 is newer than the tested range >=2.13,<2.16 (the last tested release is 2.15); the contract holds (every private torch name dtcompile relies on outside its test worlds is there with its parameters, every object it patches is there), so dynamo_vars installs""")


@_ON_THE_NEWEST_TESTED
def test_a_newer_torch_without_a_private_name_stays_stock_and_the_warning_names_it(stand_in_torch, monkeypatch, caplog):
    import torch._dynamo.guards

    stand_in_torch("2.16.0")
    monkeypatch.delattr(torch._dynamo.guards, "check_dtensor_spec")
    checks = _counting_checks(monkeypatch)
    caplog.set_level(logging.INFO, logger=LOGGER)
    installed, warned = _install_recorded()
    assert (installed, len(warned)) == (False, 1)
    assert_expected_inline(warned[0], """\
dtcompile: torch 2.16.0 is newer than the tested range >=2.13,<2.16 (the last tested release is 2.15) and breaks the contract of private torch names dtcompile relies on: torch._dynamo.guards.check_dtensor_spec (gone); Dynamo's DTensor support (dynamo_vars) is not installed and Dynamo stays stock. Install torch 2.15 (pip install 'torch>=2.13,<2.16') or report it to dtcompile.""")
    assert _install_recorded() == (False, [])  # warned once, checked once
    assert len(checks) == 1
    assert [r for r in caplog.records if r.name == LOGGER] == []


@_ON_THE_NEWEST_TESTED
def test_a_lost_parameter_and_a_patched_method_gone_from_its_class_break_the_contract(stand_in_torch, monkeypatch):
    import torch._dynamo.exc
    from torch._dynamo.variables.tensor import TensorVariable

    stand_in_torch("2.16.0")

    def unimplemented(gb_type, context, explanation):  # as if torch dropped ``hints``
        raise NotImplementedError

    monkeypatch.setattr(torch._dynamo.exc, "unimplemented", unimplemented)
    # Inherited from VariableTracker now: it resolves, but dynamo_vars replaces it on TensorVariable.
    monkeypatch.delattr(TensorVariable, "call_method")
    installed, warned = _install_recorded()
    assert installed is False
    assert "torch._dynamo.exc.unimplemented (lost the parameters ['hints'] dtcompile passes" in warned[0], warned
    assert (
        "torch._dynamo.variables.tensor.TensorVariable.call_method (no longer defined on its owner, "
        "where dynamo_vars replaces it)" in warned[0]
    ), warned


def test_an_older_torch_stays_stock_by_its_version_without_checking_the_contract(stand_in_torch, monkeypatch):
    stand_in_torch("2.12.0")
    monkeypatch.setattr(torch_contract, "contract_breaks", lambda: pytest.fail("an older torch is fenced by its version"))
    installed, warned = _install_recorded()
    assert installed is False
    assert_expected_inline(warned[0], """\
dtcompile: torch 2.12.0 is outside the tested range >=2.13,<2.16; Dynamo's DTensor support (dynamo_vars) is not installed and Dynamo stays stock. Install a tested torch (pip install 'torch>=2.13,<2.16').""")


def test_the_warning_names_the_first_few_breaks_and_counts_the_rest():
    breaks = [Break(name, "gone") for name in PRIVATE_NAMES[:5]]
    assert_expected_inline(describe(breaks), """\
torch._library.fake_class_registry.FakeScriptObject (gone), torch.fx.experimental.symbolic_shapes.optimization_hint (gone), torch.fx.experimental.symbolic_shapes.free_unbacked_symbols (gone) and 2 more""")
    assert describe(breaks[:1]) == "torch._library.fake_class_registry.FakeScriptObject (gone)"


def test_a_feature_that_needs_a_missing_name_says_so_at_its_entry(stand_in_torch, monkeypatch):
    import torch.distributed.tensor._op_schema as op_schema

    needed = ["torch.distributed.tensor._op_schema.OpStrategy", "torch._dynamo.exc.unimplemented"]
    require(needed, "dtcompile.auto_parallel")  # the running torch has both
    stand_in_torch("2.16.0")
    monkeypatch.delattr(op_schema, "OpStrategy")
    with pytest.raises(TorchContractError) as raised:
        require(needed, "dtcompile.auto_parallel")
    assert isinstance(raised.value, RuntimeError)
    assert [b.name.dotted for b in raised.value.breaks] == ["torch.distributed.tensor._op_schema.OpStrategy"]
    assert_expected_inline(str(raised.value), """\
dtcompile.auto_parallel: torch 2.16.0 lacks private torch names it relies on: torch.distributed.tensor._op_schema.OpStrategy (gone); dtcompile is tested on torch >=2.13,<2.16 (the last tested release is 2.15): install one of those (pip install 'torch>=2.13,<2.16') or report it to dtcompile""")


def test_a_feature_may_require_only_names_the_contract_lists():
    with pytest.raises(ValueError, match=r"torch\._dynamo\.not_listed.*not in torch_contract\.PRIVATE_NAMES"):
        require(["torch._dynamo.not_listed"], "dtcompile.example")


# ---- the features that check their own names at their entry

FEATURES = {
    # feature: (the module holding its _TORCH_NAMES, the package whose code uses them)
    "dtcompile.auto_parallel": ("dtcompile.auto_parallel.api", "dtcompile/auto_parallel"),
    "dtcompile.passes": ("dtcompile.passes", "dtcompile/passes"),
}


def _feature_names(feature: str) -> tuple[str, ...]:
    import importlib

    return importlib.import_module(FEATURES[feature][0])._TORCH_NAMES


def _mentioned(name: str, source: str) -> bool:
    """Whether the code in ``source`` still mentions ``name``: its last part as a word (its
    owner's for ``.default`` and a dunder: ``DTensor.__new__`` is ``DTensor(...)``)."""
    parts = name.split(".")
    last = parts[-2] if parts[-1] == "default" or parts[-1].startswith("__") else parts[-1]
    return re.search(rf"\b{re.escape(last)}\b", source) is not None


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_a_features_names_are_every_private_name_its_code_uses(feature):
    """The tuple ``require`` checks cannot go stale: every private torch name the feature's
    package references, as the contract test's scanner reads the code, is in it; every name
    in it is in the contract and still mentioned by the code."""
    names = _feature_names(feature)
    folder = ROOT / FEATURES[feature][1]
    paths = sorted(folder.rglob("*.py"))
    missing = {}
    for path in paths:
        for reference in private_torch_references(path):
            if not _covered(reference, set(names)):
                missing.setdefault(reference, str(path.relative_to(ROOT)))
    assert not missing, f"private torch names {feature} uses but its _TORCH_NAMES lacks:\n" + "\n".join(
        f"  {name}  ({where})" for name, where in sorted(missing.items())
    )
    listed = {n.dotted for n in PRIVATE_NAMES}
    assert [n for n in names if n not in listed] == [], "not in torch_contract.PRIVATE_NAMES"
    assert len(set(names)) == len(names), names
    source = "\n".join(path.read_text() for path in paths)
    assert [n for n in names if not _mentioned(n, source)] == [], f"{feature}'s code no longer uses these"


def test_auto_parallel_on_a_torch_without_one_of_its_names_says_so_at_its_entry(stand_in_torch, monkeypatch, fake_world):
    import torch
    import torch.distributed.tensor._op_schema as op_schema

    import dtcompile
    from dtcompile._testing.models import MLP
    from dtcompile.auto_parallel import api  # imported before the name is taken away

    mesh = fake_world(4, (4,), ("tp",))
    model, x = MLP(8, 16), torch.randn(4, 8)
    stand_in_torch("2.16.0")
    monkeypatch.delattr(op_schema, "OpStrategy")
    for entry in (dtcompile.auto_parallel, dtcompile.auto_parallel.plan):
        with pytest.raises(TorchContractError) as raised:
            entry(model, mesh, (x,))
        assert [b.name.dotted for b in raised.value.breaks] == ["torch.distributed.tensor._op_schema.OpStrategy"]
    assert_expected_inline(str(raised.value), """\
dtcompile.auto_parallel: torch 2.16.0 lacks private torch names it relies on: torch.distributed.tensor._op_schema.OpStrategy (gone); dtcompile is tested on torch >=2.13,<2.16 (the last tested release is 2.15): install one of those (pip install 'torch>=2.13,<2.16') or report it to dtcompile""")
    # Without the check at the entry the planner would fail deep inside, on the missing name.
    monkeypatch.setattr(api, "require", lambda names, feature: None)
    with pytest.raises((AttributeError, ImportError), match="OpStrategy"):
        dtcompile.auto_parallel.plan(model, mesh, (x,))


def test_the_passes_on_a_torch_without_one_of_their_names_say_so_before_reading_the_graph(stand_in_torch, monkeypatch):
    import torch._guards

    from dtcompile.passes import run_passes

    stand_in_torch("2.16.0")
    monkeypatch.delattr(torch._guards, "detect_fake_mode")
    with pytest.raises(TorchContractError, match=r"^dtcompile\.passes: .*torch\._guards\.detect_fake_mode \(gone\)"):
        run_passes(None, (), None)  # the check comes before the graph and the context are read


def test_require_resolves_nothing_on_a_tested_torch_and_each_name_once_on_a_newer_one(stand_in_torch, monkeypatch):
    names = _feature_names("dtcompile.auto_parallel")
    resolved: list[str] = []
    check = torch_contract.problem
    monkeypatch.setattr(torch_contract, "problem", lambda name: resolved.append(name.dotted) or check(name))
    require(names, "dtcompile.auto_parallel")
    assert resolved == []  # the contract test asserts every name on each tested release
    stand_in_torch("2.16.0")
    for _ in range(3):
        require(names, "dtcompile.auto_parallel")
    entries = [n.dotted for n in PRIVATE_NAMES if n.dotted in set(names) and torch_contract.applies(n)]
    assert sorted(resolved) == sorted(entries), "each entry resolved once, on the first call only"


def _declared() -> dict[str, list[Requirement]]:
    """pyproject.toml's requirements: ``""`` for the dependencies, else the extra's name."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {"": [Requirement(r) for r in project["dependencies"]]}
    for extra, requirements in project.get("optional-dependencies", {}).items():
        declared[extra] = [Requirement(r) for r in requirements]
    return declared


def _torch_specifiers(extras: set[str]) -> list:
    return [r.specifier for key in {"", *extras} for r in _declared().get(key, []) if r.name == "torch"]


def test_the_declared_torch_is_a_lower_bound_that_admits_a_newer_release():
    (specifier,) = _torch_specifiers(set())
    low = ".".join(map(str, TESTED_TORCH[0]))
    for version in (f"{low}.0", "2.15.0", "2.16.0", "2.16.0+cu130", "2.17.0", "3.0.0"):
        assert specifier.contains(version), f"pyproject.toml's torch{specifier} refuses torch {version}"
    assert not specifier.contains("2.12.0") and not specifier.contains("2.12.9"), specifier
    assert all(s.operator in (">=", ">", "!=") for s in specifier), f"torch{specifier}: an upper pin"
    assert len(_torch_specifiers(set(_declared()))) == 1, "an extra declares torch again"


def _installs(markdown: str) -> list[list[str]]:
    """The arguments of each ``pip install`` in ``markdown``'s bash blocks, in order."""
    installs = []
    for block in re.findall(r"^```bash\n(.*?)^```$", markdown, flags=re.MULTILINE | re.DOTALL):
        for line in block.splitlines():
            for command in line.split("&&"):
                words = shlex.split(command, comments=True)
                if len(words) >= 2 and words[0].endswith("pip") and words[1] == "install":
                    installs.append(words[2:])
    return installs


def _user_torch_then_ours(installs: list[list[str]]) -> list[tuple[str | None, set[str]]]:
    """Each torch installed first and the install of dtcompile after it: ``(the pinned
    version, or None for the newest; the extras)``."""
    pairs, torch_first, pinned = [], False, None
    for words in installs:
        for word in (w for w in words if not w.startswith("-")):
            if word == "torch" or word.startswith("torch=="):
                torch_first, pinned = True, word.partition("==")[2] or None
            elif word.startswith(".") and torch_first:
                extras = set(re.findall(r"\[(.*)\]", word)[0].split(",")) if "[" in word else set()
                pairs.append((pinned, extras))
    return pairs


@pytest.mark.parametrize("page", ["README.md", "docs/getting-started.md", "docs/contributing.md", "docs/supported-torch.md"])
def test_the_install_lines_never_make_pip_replace_the_users_torch(page):
    pairs = _user_torch_then_ours(_installs((ROOT / page).read_text()))
    if page == "README.md":
        assert (None, {"test"}) in pairs, "README.md lost its install: pip install torch, then pip install '.[test]'"
    assert pairs, f"{page} shows no torch installed before dtcompile"
    for version, extras in pairs:
        # The newest torch: today's, and the releases to come.
        for admitted in [version] if version else ["2.15.0", "2.16.0", "2.17.0"]:
            for specifier in _torch_specifiers(extras):
                assert specifier.contains(admitted), (
                    f"{page}: torch {admitted} installed first, then dtcompile{sorted(extras)} needs torch{specifier}: "
                    "pip would replace the user's torch"
                )
