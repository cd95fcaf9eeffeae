"""The house's layers only point down, package by package and module by module, with no circles.

Packages, bottom first (the folders; a package imports its own or a lower one):

0. ``dtcompile.base`` -- the names, notation, torch contract and compatibility layer,
   scoped patches, sizes, progress; it imports no other package of ours
1. ``dtcompile.hops`` -- the ``local_map`` region op
2. ``dynamo_vars`` -- Dynamo support
3. ``dtcompile`` -- the backend and all that is built on it
4. ``dtcompile_tools`` (``tools/``) -- the report command, the pytest plugin

``dtcompile.hops`` and ``dynamo_vars`` reach the base without loading the backend: the
``dtcompile`` package's ``__init__`` imports nothing of ours when it runs (its names
load on first use), which :func:`test_the_package_face_imports_nothing_when_it_runs`
checks here and ``tests/architecture/test_no_side_effects.py`` checks in a fresh
interpreter.

Module layers, bottom first, package by package (docs/layout.md says the same); a
module may import modules of its own layer or below, never above:

0. base -- ``dtcompile.base``
1. ``dtcompile.hops``
2. ``dynamo_vars``
3. graph facts -- ``dtcompile.graph`` (collectives, regions, memory, rank-dependent sizes)
4. ``dtcompile.cost`` (formulas, profiles, the ``auto`` choice, ``simulate``, ``calibrate``)
5. SPMD types -- ``dtcompile.spmd``
6. options -- ``dtcompile.pass_names`` (the pass table), ``dtcompile.config``
7. records and keys -- ``dtcompile.annotations``, ``dtcompile.records``,
   ``dtcompile.artifacts``, ``dtcompile.cache_keys``
8. ranks -- ``dtcompile.ranks`` (what ranks agree on, their check, their shared plans)
9. ``dtcompile.passes``
10. the back half -- ``dtcompile.pipeline`` (its stages, the compile log)
11. the front doors -- ``dtcompile.compiler`` (the Dynamo backend), ``dtcompile.step``
    (``compile_step``), and ``dtcompile.auto_parallel`` (the placement solver)
12. ``dtcompile.registry`` (``dtcompile.backend``), ``dtcompile.report`` (``explain``)
13. the package face -- ``dtcompile`` (``__init__``)
14. ``dtcompile.testing``
15. applications -- ``dtcompile._testing``, ``dtcompile.demo``, ``dtcompile.integrations``
    (other projects' compilers: torchtitan graph_trainer's ``dtcompile`` pass pipeline), ``dtcompile_tools``

Every import counts for the layers, also one inside a function or under
``TYPE_CHECKING``; circles are looked for among the imports that run.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from support.library import OURS, modules

ROOT = Path(__file__).resolve().parents[2]

PACKAGE_LAYERS: tuple[str, ...] = ("dtcompile.base", "dtcompile.hops", "dynamo_vars", "dtcompile", "dtcompile_tools")

LAYERS: tuple[tuple[str, ...], ...] = (
    ("dtcompile.base",),
    ("dtcompile.hops",),
    ("dynamo_vars",),
    ("dtcompile.graph",),
    ("dtcompile.cost",),
    ("dtcompile.spmd",),
    ("dtcompile.pass_names", "dtcompile.config"),
    ("dtcompile.annotations", "dtcompile.records", "dtcompile.artifacts", "dtcompile.cache_keys"),
    ("dtcompile.ranks",),
    ("dtcompile.passes",),
    ("dtcompile.pipeline",),
    ("dtcompile.compiler", "dtcompile.step", "dtcompile.auto_parallel"),
    ("dtcompile.registry", "dtcompile.report"),
    ("dtcompile",),
    ("dtcompile.testing",),
    ("dtcompile._testing", "dtcompile.demo", "dtcompile.integrations", "dtcompile_tools"),
)



def layer_of(module: str) -> int:
    """The layer of ``module``: that of the longest prefix listed in :data:`LAYERS`."""
    best, best_len = None, -1
    for index, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > best_len:
                best, best_len = index, len(name)
    if best is None:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS and to docs/layout.md")
    return best


def package_of(module: str) -> int:
    """The package layer of ``module``: the longest prefix in :data:`PACKAGE_LAYERS`."""
    found = [(len(name), index) for index, name in enumerate(PACKAGE_LAYERS) if module == name or module.startswith(name + ".")]
    if not found:
        raise AssertionError(f"{module} is in no package: add its package to PACKAGE_LAYERS")
    return max(found)[1]


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports(module: str, source: str, known: set[str]) -> list[tuple[str, int, bool]]:
    """``(imported module, line, runs)`` for every import of ours in ``source``;
    ``runs`` is False under ``if TYPE_CHECKING:``."""
    found: list[tuple[str, int, bool]] = []

    def add(name: str, line: int, runs: bool) -> None:
        if name.split(".")[0] in OURS:
            # ``from pkg import name`` imports pkg.name when that is a module.
            found.append((name, line, runs))

    def visit(node: ast.AST, runs: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.body:
                visit(child, False)
            for child in node.orelse:
                visit(child, runs)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno, runs)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                add(full if full in known else node.module, node.lineno, runs)
        for child in ast.iter_child_nodes(node):
            visit(child, runs)

    visit(ast.parse(source), True)
    return found


def violations(sources: dict[str, str]) -> list[str]:
    """Upward imports (between packages, then between layers) and import circles among
    ``sources`` (module name -> source text).  A package imports only its own or lower
    packages, so packages have no circles either."""
    known = set(sources)
    problems = []
    graph: dict[str, set[str]] = {m: set() for m in sources}
    for module, source in sources.items():
        for imported, line, runs in imports(module, source, known):
            if imported not in known:
                imported = next((k for k in sorted(known, key=len, reverse=True) if imported.startswith(k + ".")), imported)
            if imported == module or imported not in known:
                continue
            if package_of(imported) > package_of(module):
                problems.append(
                    f"{module}:{line} imports {imported}: package {PACKAGE_LAYERS[package_of(module)]} "
                    f"imports {PACKAGE_LAYERS[package_of(imported)]}, a higher one"
                )
            elif layer_of(imported) > layer_of(module):
                problems.append(
                    f"{module}:{line} imports {imported}, a higher layer "
                    f"({layer_of(module)} -> {layer_of(imported)})"
                )
            if runs:
                graph[module].add(imported)
    # Circles: depth-first search for back edges.
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt) :] + [nxt]
                problems.append("import circle: " + " -> ".join(cycle))
            elif nxt not in state:
                dfs(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            dfs(node)
    return problems


def test_every_module_is_in_a_layer():
    for module in modules():
        layer_of(module)


def test_layers_only_point_down_and_there_are_no_import_circles():
    sources = {name: path.read_text() for name, path in modules().items()}
    assert violations(sources) == []


@pytest.mark.parametrize(
    "sources, expected",
    [
        (
            {"dtcompile.graph.collectives": "from dtcompile.compiler import backend\n", "dtcompile.compiler": ""},
            "dtcompile.graph.collectives:1 imports dtcompile.compiler, a higher layer (3 -> 11)",
        ),
        (
            {"dtcompile.cost": "def f():\n    from dtcompile.report import explain\n", "dtcompile.report": ""},
            "dtcompile.cost:2 imports dtcompile.report, a higher layer (4 -> 12)",
        ),
        (
            {"dtcompile.graph.regions": "import dtcompile.graph.memory\n", "dtcompile.graph.memory": "from dtcompile.graph import regions\n"},
            "import circle: dtcompile.graph.memory -> dtcompile.graph.regions -> dtcompile.graph.memory",
        ),
        (
            # hops back on the backend: the circle the folders had, hops -> dtcompile -> hops
            {"dtcompile.hops.spec": "from dtcompile.graph.collectives import CollectiveInfo\n", "dtcompile.graph.collectives": ""},
            "dtcompile.hops.spec:1 imports dtcompile.graph.collectives: package dtcompile.hops imports dtcompile, a higher one",
        ),
        (
            {"dtcompile.base.notation": "def f():\n    from dtcompile.hops.spec import RegionSpec\n", "dtcompile.hops.spec": ""},
            "dtcompile.base.notation:2 imports dtcompile.hops.spec: package dtcompile.base imports dtcompile.hops, a higher one",
        ),
    ],
    ids=["upward", "upward-inside-a-function", "circle", "package-upward", "base-imports-a-package"],
)
def test_the_check_fails_on_an_upward_import_and_on_a_circle(sources, expected):
    assert expected in violations(sources)


def test_type_checking_imports_are_no_circle():
    sources = {
        "dtcompile.records": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from dtcompile.annotations import C\n",
        "dtcompile.annotations": "def f():\n    from dtcompile.records import X\n",
    }
    assert violations(sources) == []


def test_the_package_face_imports_nothing_when_it_runs():
    """``import dtcompile.base`` (what hops and dynamo_vars do) runs ``dtcompile/__init__.py``
    first: it must load nothing of ours, or the base would pull the backend in."""
    path = ROOT / "dtcompile" / "__init__.py"
    running = [(name, line) for name, line, runs in imports("dtcompile", path.read_text(), set(modules())) if runs]
    assert running == []


def test_the_face_check_sees_an_import_that_runs():
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from dtcompile.compiler import X\nimport dtcompile.registry\n"
    assert [(n, line) for n, line, runs in imports("dtcompile", source, {"dtcompile.registry"}) if runs] == [("dtcompile.registry", 4)]


MAX_LINES = 600


def test_no_library_file_is_over_600_lines():
    """A file past 600 lines holds more than one thing; split it where its parts meet."""
    long = {name: n for name, path in modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}
