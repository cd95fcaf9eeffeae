"""Every change the library makes outside its own objects is in :data:`dtcompile.base.process_changes.CHANGES`.

The scan reads the code of ``dtcompile``, ``dynamo_vars``, ``dtcompile.hops`` and ``tools`` for
the forms such a change takes, per function:

- ``setattr``/``delattr`` on anything but ``self``/``cls``;
- a write, ``del`` or augmented assignment through an imported name (``copyreg.dispatch_table[k] = v``,
  ``registry._COMPILER_FNS[...]``), or through a local that holds an imported object's
  private state (``table = VariableBuilder._id_dispatch()``) or one that a function of the
  module hands out (``handlers = _loss_ops()``, which returns DTensor's handler table);
- a mutating call (``update``, ``pop``, ``clear``, ``patch``, ...) on such an object;
- ``global`` (module state rebound at run time);
- a registration (``torch.library.custom_op``, ``register_fake``, ``ScopedPatch``, ...);
- a switch of an imported module (``_set_*``, ``_install_*``, ``enable_*``, ``disable*``, ``gc.freeze``).

A function that does one of these and is not listed fails the test, and so does an entry
that no longer matches a function that does.  The plant below shows both.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import NamedTuple

from support.library import modules

from dtcompile.base.process_changes import CHANGES, Change, Scope

MUTATORS = frozenset({"update", "pop", "popitem", "setdefault", "clear", "append", "extend", "insert", "remove",
                      "add", "discard", "patch", "__setitem__", "__delitem__", "cache_clear"})
REGISTERS = frozenset({"custom_op", "register_fake", "register_autograd", "register_kernel", "Library", "define", "impl",
                       "register_op_strategy", "register_sharding", "register_lowering", "add_safe_globals",
                       "register_pytree_node", "ScopedPatch"})


SWITCH = re.compile(r"^_*(set|install|uninstall|register|enable|disable|freeze|unfreeze)(_|$)")


class Site(NamedTuple):
    module: str
    function: str  # qualified name of the enclosing function, "<module>" at module level
    kind: str
    line: int
    code: str


def _root(node):
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _private_chain(node) -> bool:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            return True
        node = node.func if isinstance(node, ast.Call) else node.value
    return False


def sites(path: Path, module: str) -> list[Site]:
    source = path.read_text()
    tree = ast.parse(source)
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported |= {a.asname or a.name for a in node.names}

    def shared_expr(expr, local_shared) -> bool:
        """An object that lives outside this call: reached from an import through a private name."""
        root = _root(expr)
        if root in local_shared:
            return True
        return root in imported and _private_chain(expr)

    # module functions that hand out shared objects (``return DTensor._op_dispatcher._custom_op_handlers``)
    hands_out = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            for ret in ast.walk(node):
                if isinstance(ret, ast.Return) and ret.value is not None:
                    values = ret.value.elts if isinstance(ret.value, ast.Tuple) else [ret.value]
                    if any(shared_expr(v, set()) for v in values):
                        hands_out.add(node.name)

    found: list[Site] = []

    def add(kind, node, scope):
        found.append(Site(module, scope, kind, node.lineno, ast.get_source_segment(source, node).splitlines()[0][:120]))

    def names_of(target):
        if isinstance(target, ast.Name):
            return [target.id]
        if isinstance(target, (ast.Tuple, ast.List)):
            return [n for e in target.elts for n in names_of(e)]
        return []

    def visit(node, scope, local_shared):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            inner = node.name if scope == "<module>" else f"{scope}.{node.name}"
            body_shared = set() if isinstance(node, ast.ClassDef) else set(local_shared)
            for child in node.body:
                visit(child, inner, body_shared)
            for deco in getattr(node, "decorator_list", ()):
                visit(deco, scope, local_shared)
            return
        if isinstance(node, ast.Global):
            add("global", node, scope)
        elif isinstance(node, ast.Assign):
            value = node.value
            is_shared = shared_expr(value, local_shared) or (
                isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id in hands_out
            )
            for target in node.targets:
                if is_shared:
                    local_shared.update(names_of(target))
                for t in ([target] if not isinstance(target, (ast.Tuple, ast.List)) else target.elts):
                    if isinstance(t, (ast.Attribute, ast.Subscript)) and _root(t) not in ("self", "cls") and (
                        _root(t) in imported or _root(t) in local_shared
                    ):
                        add("write", node, scope)
        elif isinstance(node, (ast.AugAssign, ast.Delete)):
            for t in (node.targets if isinstance(node, ast.Delete) else [node.target]):
                if isinstance(t, (ast.Attribute, ast.Subscript)) and (_root(t) in imported or _root(t) in local_shared):
                    add("write", node, scope)
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
            if name in ("setattr", "delattr") and node.args and _root(node.args[0]) not in ("self", "cls"):
                add("setattr", node, scope)
            elif name and SWITCH.match(name) and isinstance(func, ast.Attribute) and _root(func) in imported:
                add("switch", node, scope)
            elif name in REGISTERS:
                add("register", node, scope)
            elif isinstance(func, ast.Attribute) and name in MUTATORS and (
                _root(func.value) in local_shared or (_root(func.value) in imported and _root(func.value) not in ("self",))
            ):
                add("mutate", node, scope)
        for child in ast.iter_child_nodes(node):
            visit(child, scope, local_shared)

    for node in tree.body:
        visit(node, "<module>", set())
    return found


def found_changes(module_paths: dict[str, Path]) -> dict[tuple[str, str], list[Site]]:
    found: dict[tuple[str, str], list[Site]] = {}
    for module, path in module_paths.items():
        for site in sites(path, module):
            found.setdefault((site.module, site.function), []).append(site)
    return found


def unlisted_and_stale(found: dict[tuple[str, str], list[Site]], listed) -> tuple[list[str], list[str]]:
    keys = {(c.module, c.function) for c in listed}
    unlisted = [f"{s.module}:{s.line} in {s.function}: {s.kind} `{s.code}`" for key in sorted(set(found) - keys) for s in found[key]]
    stale = [f"{m}.{f}" for m, f in sorted(keys - set(found))]
    return unlisted, stale


def test_every_change_to_the_process_is_listed_and_every_entry_still_makes_one():
    unlisted, stale = unlisted_and_stale(found_changes(modules()), CHANGES)
    assert unlisted == [], "changes outside dtcompile's own objects, not in dtcompile/base/process_changes.py CHANGES:\n" + "\n".join(unlisted)
    assert stale == [], f"CHANGES entries whose function makes no change (any more): {stale}"


def test_each_entry_says_how_long_its_change_lasts():
    assert len({(c.module, c.function) for c in CHANGES}) == len(CHANGES)
    for change in CHANGES:
        assert isinstance(change.scope, Scope) and change.why.strip(), change


def test_the_scan_finds_a_planted_change(tmp_path):
    """An unlisted change of each form fails the check; a listed one passes; a stale entry fails."""
    planted = tmp_path / "planted.py"
    planted.write_text(
        "import copyreg\n"
        "import torch\n"
        "from torch._dynamo.variables.builder import VariableBuilder\n"
        "from torch.distributed.tensor import DTensor\n"
        "_mine = {}\n"
        "def handlers():\n"
        "    return DTensor._op_dispatcher._custom_op_handlers\n"
        "def patch_module():\n"
        "    setattr(torch.nn.Module, 'forward', None)\n"
        "def write_copyreg():\n"
        "    copyreg.dispatch_table[int] = None\n"
        "def through_a_local():\n"
        "    table = VariableBuilder._id_dispatch()\n"
        "    table[1] = None\n"
        "def through_a_handed_out_table():\n"
        "    table = handlers()\n"
        "    table.pop(1, None)\n"
        "def rebinds():\n"
        "    global _mine\n"
        "    _mine = {}\n"
        "def switches():\n"
        "    torch._C._set_grad_enabled(False)\n"
        "def harmless(x):\n"
        "    local = {}\n"
        "    local[1] = torch.zeros(2)\n"
        "    _mine[1] = x\n"
        "    return torch.Generator().manual_seed(0)\n"
    )
    found = found_changes({"planted": planted})
    assert sorted(found) == [
        ("planted", f) for f in ("patch_module", "rebinds", "switches", "through_a_handed_out_table", "through_a_local", "write_copyreg")
    ]
    assert [s.kind for key in sorted(found) for s in found[key]] == ["setattr", "global", "switch", "mutate", "write", "write"]
    listed = [Change("planted", f, Scope.CALL, "planted") for f in ("patch_module", "rebinds", "switches", "through_a_local", "write_copyreg", "gone")]
    unlisted, stale = unlisted_and_stale(found, listed)
    assert unlisted == ["planted:17 in through_a_handed_out_table: mutate `table.pop(1, None)`"]
    assert stale == ["planted.gone"]
