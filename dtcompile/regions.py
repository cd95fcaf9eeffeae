"""``local_map`` regions in the AOT graphs: formatted, and inlined (and described) at lowering.

While dtcompile's AOTAutograd traces, :func:`hops.keep_regions` is on, so each
``local_map`` region stays one ``local_map_region(body, spec, *operands)`` node
in the forward graph and one (``spec.backward``) in the backward graph.  The
passes see the region as one op; :func:`inline_regions`, the first step of
lowering, splices each body into its graph (Inductor has no lowering for the
op) and tags the spliced nodes with the region's name.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx

from dtcompile.annotations import DynamoGraphInfo, charge_collective
from dtcompile.collectives import collective_info
from hops.local_map import RegionSpec, _spec, local_map_region

__all__ = [
    "RegionInfo",
    "format_with_regions",
    "inline_regions",
    "is_region",
    "issues_collectives",
    "region_body",
]


@dataclass(frozen=True)
class RegionInfo:
    """One region node of an AOT graph."""

    node: str
    """The region node's name in the AOT graph."""
    spec: RegionSpec
    ops: int
    """Call nodes in its body."""
    collectives: tuple[str, ...]
    """The collectives its body issues (``all_reduce[tp] x4 ...``)."""

    def __str__(self) -> str:
        inner = f"; issues {', '.join(self.collectives)}" if self.collectives else ""
        return f"{self.node}: {self.spec} ({self.ops} ops{inner})"


def is_region(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is local_map_region


def region_body(node: fx.Node) -> fx.GraphModule:
    """A region node's body: the submodule of its graph's module that its first argument names."""
    return getattr(node.graph.owning_module, node.args[0].target)


def issues_collectives(node: fx.Node) -> bool:
    """Whether ``node`` is a region whose body issues a collective."""
    return is_region(node) and any(collective_info(n) is not None for n in region_body(node).graph.nodes)


def _target(node: fx.Node) -> str:
    if node.op == "call_method":
        return f".{node.target}"
    target = node.target
    if isinstance(target, str):
        return target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)
    return getattr(target, "__name__", None) or str(target)


def _arg(arg: object) -> str:
    if isinstance(arg, fx.Node):
        return arg.name
    if isinstance(arg, (list, tuple)):
        inner = ", ".join(_arg(a) for a in arg)
        return (
            f"[{inner}]"
            if isinstance(arg, list)
            else f"({inner}{',' if len(arg) == 1 else ''})"
        )
    return repr(arg)


def format_with_regions(gm: fx.GraphModule) -> str:
    """``gm``'s call nodes, one line each, a region as one line with its spec and its body indented.

    ``region = local_map[gelu_scale on (tp=4): [S(0)] -> [S(0)] | grads [S(0)]](x)``
    """
    lines = []
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        if is_region(node):
            operands = ", ".join(_arg(a) for a in node.args[2:])
            lines.append(f"{node.name} = local_map[{node.args[1]}]({operands})")
            body = region_body(node)
            inputs = ", ".join(n.name for n in body.graph.find_nodes(op="placeholder"))
            lines.append(f"    def {node.args[0].target}({inputs}):")
            lines += [
                "        " + line for line in format_with_regions(body).splitlines()
            ]
            outputs = body.graph.find_nodes(op="output")[0].args[0]
            lines.append(f"        return {_arg(tuple(outputs))}")
            continue
        args = [_arg(a) for a in node.args] + [
            f"{k}={_arg(v)}" for k, v in node.kwargs.items()
        ]
        lines.append(f"{node.name} = {_target(node)}({', '.join(args)})")
    return "\n".join(lines)


def inline_regions(
    gm: fx.GraphModule, info: DynamoGraphInfo | None = None
) -> list[RegionInfo]:
    """Splices every region's body into ``gm`` in place; returns what it inlined.

    Spliced nodes get ``meta["dtcompile_region"]`` (the region node's name) and an
    annotation: the region node's own (its Dynamo node and placement, from the
    ``annotate`` pass), or for a collective its cost under ``info``'s profile
    (charged to the region's Dynamo node), then which region it is in.  The
    region's outputs (``getitem`` users) become the body's outputs.
    """
    axes = info.axes if info is not None else None
    kind = gm.meta.get("dtcompile_graph_kind", "forward")
    inlined = []
    for node in list(gm.graph.nodes):
        if not is_region(node):
            continue
        spec = _spec(node.args[1])
        where = f"in local_map region {spec.name} ({node.name})"
        region_note = node.meta.get("dtcompile_annotation")
        source = node.meta.get("dtcompile_source")
        body = region_body(node)
        ops, collectives = 0, []
        env: dict[fx.Node, fx.Node] = {}
        placeholders = body.graph.find_nodes(op="placeholder")
        operands = node.args[2:]
        if len(placeholders) != len(operands):
            raise AssertionError(
                f"region {node.name}: {len(operands)} operands for {len(placeholders)} body inputs"
            )
        env.update(zip(placeholders, operands))
        outputs: tuple[fx.Node, ...] = ()
        with gm.graph.inserting_before(node):
            for inner in body.graph.nodes:
                if inner.op == "placeholder":
                    continue
                if inner.op == "output":
                    outputs = tuple(fx.map_arg(inner.args[0], env.__getitem__))
                    continue
                if inner.op == "get_attr":
                    raise AssertionError(
                        f"region {node.name}: body reads attribute {inner.target}"
                    )
                copied = gm.graph.node_copy(inner, env.__getitem__)
                copied.meta["dtcompile_region"] = node.name
                ops += copied.op == "call_function"
                collective = collective_info(copied, axes)
                if collective is not None:
                    collectives.append(collective.short)
                    cost = charge_collective(copied, collective, kind, info, source) if info is not None else collective.short
                    note = f"{cost}; {where}"
                else:
                    note = f"{region_note}; {where}" if region_note else where
                copied.meta["dtcompile_annotation"] = note
                env[inner] = copied
        for user in list(node.users):
            if user.op == "call_function" and user.target is operator.getitem:
                user.replace_all_uses_with(outputs[user.args[1]])
                gm.graph.erase_node(user)
            else:
                raise AssertionError(
                    f"region {node.name}: used by {user.format_node()}, not by getitem"
                )
        body_attr = node.args[0]
        gm.graph.erase_node(node)
        if not body_attr.users:
            gm.graph.erase_node(body_attr)
            delattr(gm, body_attr.target)
        inlined.append(RegionInfo(node.name, spec, ops, tuple(collectives)))
    if inlined:
        gm.graph.lint()
        gm.recompile()
    return inlined
