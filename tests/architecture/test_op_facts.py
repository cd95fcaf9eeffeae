"""Facts about ops live in one module, :mod:`dtcompile.base.op_facts`: no other module of the
library names ops its own way or keeps its own table of collectives, waits or views.

The scan flags, outside that module:

- a function called ``op_name`` or ``_op_name``;
- a module-level name for an op table (``_VIEWS``, ``_RESHAPING``, ``_WAIT``, ``_COLLECTIVES``...);
- a ``torch.ops._c10d_functional.<op>.default`` held in a name (a second ``_WAIT``);
- a literal set or tuple of three or more view op names (a view table under another name).
"""

from __future__ import annotations

import ast
import re

from support.library import modules

from dtcompile.base import op_facts

HOME = "dtcompile.base.op_facts"
TABLE_NAME = re.compile(r"^_?([A-Z]+_)*(VIEWS?|RESHAP[A-Z]*|WAITS?|COLLECTIVES?)(_[A-Z]+)*$")
VIEW_NAMES = op_facts.RESHAPES | op_facts.TRANSPOSES | op_facts.UNIT_DIMS | {"expand"}


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def second_definitions(sources: dict[str, str]) -> list[str]:
    """``module:line what`` for every op fact defined outside :data:`HOME`."""
    found = []
    for module, source in sorted(sources.items()):
        if module == HOME:
            continue
        tree = ast.parse(source)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in ("op_name", "_op_name"):
                found.append(f"{module}:{node.lineno} defines {node.name}")
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = [t.id for t in targets if isinstance(t, ast.Name)]
                value = node.value
                if value is None:
                    continue
                if node in tree.body and any(TABLE_NAME.match(name) for name in names):
                    found.append(f"{module}:{node.lineno} defines the op table {names[0]}")
                elif re.search(r"_c10d_functional\.\w+\.default$", _dotted(value)):
                    found.append(f"{module}:{node.lineno} holds {_dotted(value)} in {names or 'a name'}")
            if isinstance(node, (ast.Set, ast.Tuple, ast.List)):
                words = {e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
                if len(words & VIEW_NAMES) >= 3:
                    found.append(f"{module}:{node.lineno} lists view ops {sorted(words & VIEW_NAMES)}")
    return found


def test_op_facts_are_defined_once():
    sources = {name: path.read_text() for name, path in modules().items()}
    assert HOME in sources
    found = second_definitions(sources)
    assert not found, "op facts belong in dtcompile/base/op_facts.py:\n" + "\n".join(found)


def test_a_planted_second_definition_is_found():
    planted = {
        "dtcompile.passes.x": "import torch\n_WAIT = torch.ops._c10d_functional.wait_tensor.default\n",
        "dtcompile.memory_x": "def _op_name(node):\n    return str(node.target)\n",
        "dtcompile.spmd_x": "_SHAPE_ONLY = frozenset({'view', 'reshape', 'squeeze', 'clone'})\n",
        "dtcompile.edges_x": "def f(n):\n    return n in ('t', 'permute', 'transpose')\n",
        "dtcompile.base.op_facts": "_VIEWS = {'view', 'reshape', 't'}\n",
    }
    found = second_definitions(planted)
    assert [f.split(":")[0] for f in found] == ["dtcompile.edges_x", "dtcompile.memory_x", "dtcompile.passes.x",
                                                 "dtcompile.spmd_x"], found
    assert "defines the op table _WAIT" in found[2], found
    held = second_definitions(
        {"dtcompile.y": "import torch\ndef f():\n    wait = torch.ops._c10d_functional.wait_tensor.default\n"}
    )
    assert held == ["dtcompile.y:3 holds torch.ops._c10d_functional.wait_tensor.default in ['wait']"], held
