"""The names that tie files together live in :mod:`dtcompile.base.channels`, and nowhere else.

No file but ``dtcompile/base/channels.py`` spells out a node-meta key, an artifact name or
a folder beside the compile cache (docstrings may name them); the library compares
graph kinds with :class:`~dtcompile.base.channels.GraphKind`, never with a bare string.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from dtcompile.base.channels import Artifact, BesideCacheFolders, GraphKind, Meta, parse_artifact

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ("dtcompile", "dynamo_vars", "hops", "tools")
EVERYWHERE = (*LIBRARY, "tests", "examples", "benchmarks")
CHANNELS = ROOT / "dtcompile" / "base" / "channels.py"

# Names that start like a channel but are none: the package dtcompile_tools, the
# local_map HOP's name and auto-parallel's op namespace, the report's default
# folder, and names tests give their own temporary folders and backends; the name
# torchtitan's graph_trainer knows dtcompile's step pass by (dtcompile.integrations.torchtitan).
NOT_CHANNELS = {
    "dtcompile_tools",
    "dtcompile_step_pass",
    "dtcompile_local_map",
    "dtcompile_autoparallel",
    "dtcompile_report",
    "dtcompile_inductor",
    "dtcompile_trace",
    "dtcompile_ap_test",
    "dtcompile_fuzz_report",
}
_SPELLED = re.compile(r"dtcompile_\w*")
_KINDS = {k.value for k in GraphKind}


def _strings(tree: ast.AST):
    """The string constants of a module, but documentation (string statements)."""
    docs = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            yield node


def spelled_channels(folders, root: Path = ROOT) -> list[str]:
    found = []
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            if path in (CHANNELS, Path(__file__).resolve()):  # the channels, and the plants below
                continue
            for node in _strings(ast.parse(path.read_text())):
                for name in _SPELLED.findall(node.value):
                    if name not in NOT_CHANNELS:
                        found.append(f"{path.relative_to(root)}:{node.lineno}: {name!r}")
    return found


def kind_compared_as_a_string(folders, root: Path = ROOT) -> list[str]:
    """``x == "forward"``, ``"backward" != x``, ``x in ("forward", ...)``."""
    found = []
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.Compare):
                    continue
                sides = [node.left, *node.comparators]
                for op, right in zip(node.ops, node.comparators):
                    left = sides[sides.index(right) - 1]
                    if isinstance(op, (ast.Eq, ast.NotEq, ast.Is, ast.IsNot)):
                        values = [s.value for s in (left, right) if isinstance(s, ast.Constant)]
                    elif isinstance(op, (ast.In, ast.NotIn)) and isinstance(right, (ast.Tuple, ast.List, ast.Set)):
                        values = [e.value for e in right.elts if isinstance(e, ast.Constant)]
                    else:
                        continue
                    if any(v in _KINDS for v in values):
                        found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_no_file_spells_out_a_channel():
    assert spelled_channels(EVERYWHERE) == []


def test_the_library_compares_graph_kinds_as_graph_kinds():
    assert kind_compared_as_a_string(LIBRARY) == []


def test_the_checks_find_what_is_planted(tmp_path):
    planted = tmp_path / "planted"
    planted.mkdir()
    (planted / "m.py").write_text(
        '"""Names dtcompile_annotation in a docstring: fine."""\n'
        'def f(node, kind):\n'
        '    note = node.meta["dtcompile_annotation"]\n'
        '    name = f"dtcompile_{kind}_graph"\n'
        '    return kind == "backward" or kind in ("forward", "inference")\n'
    )
    assert spelled_channels(["planted"], tmp_path) == ["planted/m.py:3: 'dtcompile_annotation'", "planted/m.py:4: 'dtcompile_'"]
    assert kind_compared_as_a_string(["planted"], tmp_path) == ["planted/m.py:5", "planted/m.py:5"]


@pytest.mark.parametrize("kind", list(GraphKind))
def test_every_artifact_name_reads_back_as_what_it_is(kind):
    assert parse_artifact(Artifact.graph(kind)) == ("graph", kind)
    assert parse_artifact(Artifact.collectives(kind)) == ("collectives", kind)
    assert parse_artifact(Artifact.regions(kind)) == ("regions", kind)
    assert parse_artifact(Artifact.pass_graph(kind, "before", "bucketing")) is None
    assert parse_artifact(Artifact.PLACEMENTS) == ("placements", None)
    assert parse_artifact("dynamo_graph_break_reason") is None
    # A kind is a string where one is printed, formatted or serialized.
    assert f"{kind}" == str(kind) == kind.value and f"{kind:>9}" == f"{kind.value:>9}"


def test_channel_values_are_distinct():
    values = [v for cls in (Meta, Artifact, BesideCacheFolders) for k, v in vars(cls).items() if k.isupper()]
    assert len(values) == len(set(values)) and all(v.startswith("dtcompile_") for v in values)
