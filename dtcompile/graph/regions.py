"""``local_map`` regions in the AOT graphs: found, described and formatted.

While dtcompile's AOTAutograd traces, :func:`dtcompile.hops.keep_regions` is on, so each
``local_map`` region stays one ``local_map_region(body, spec, *operands)`` node
in the forward graph and one (``spec.backward``) in the backward graph.  The
passes see the region as one op; :func:`dtcompile.pipeline.lowering.inline_regions`,
the first step of lowering, splices each body into its graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from dtcompile.graph.collectives import collective_info
from dtcompile.hops.region_op import local_map_region
from dtcompile.hops.spec import RegionSpec

__all__ = [
    "RegionInfo",
    "format_with_regions",
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
    call: int | None = None
    """The id pairing a forward region with its backward (:func:`dtcompile.hops.region_op.region_call_id`)."""

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
