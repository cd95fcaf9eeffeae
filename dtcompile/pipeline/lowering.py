"""Lowering's first step: ``local_map`` regions inlined (and described) before Inductor.

Inductor has no lowering for the region op, so :func:`inline_regions` splices
each region's body into its graph after the passes, tagging the spliced nodes
with the region's name and annotation.
"""

from __future__ import annotations

import operator

from torch import fx

from dtcompile.annotations import DynamoGraphInfo, charge_collective
from dtcompile.base.channels import GraphKind, Meta
from dtcompile.graph.collectives import collective_info
from dtcompile.graph.regions import RegionInfo, is_region, region_body
from dtcompile.hops.region_op import region_call_id
from dtcompile.hops.spec import RegionSpec

__all__ = ["inline_regions"]


def inline_regions(
    gm: fx.GraphModule, info: DynamoGraphInfo | None = None, kind: GraphKind = GraphKind.FORWARD
) -> list[RegionInfo]:
    """Splices every region's body into ``gm`` in place; returns what it inlined.

    Spliced nodes get ``meta["dtcompile_region"]`` (the region node's name) and an
    annotation: the region node's own (its Dynamo node and placement, from the
    ``annotate`` pass), or for a collective its cost under ``info``'s profile
    (charged to the region's Dynamo node), then which region it is in.  The
    region's outputs (``getitem`` users) become the body's outputs.  ``kind`` is
    the graph's (``forward``, ``backward``, ``inference``), for the collectives' charges.
    ``gm.code`` is left as it was: the caller recompiles.
    """
    axes = info.axes if info is not None else None
    inlined = []
    for node in list(gm.graph.nodes):
        if not is_region(node):
            continue
        spec = RegionSpec.of(node.args[1])
        where = f"in local_map region {spec.name} ({node.name})"
        region_note = node.meta.get(Meta.ANNOTATION)
        source = node.meta.get(Meta.SOURCE)
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
                copied.meta[Meta.REGION] = node.name
                ops += copied.op == "call_function"
                collective = collective_info(copied, axes)
                if collective is not None:
                    collectives.append(collective.short)
                    cost = charge_collective(copied, collective, kind, info, source) if info is not None else collective.short
                    note = f"{cost}; {where}"
                else:
                    note = f"{region_note}; {where}" if region_note else where
                copied.meta[Meta.ANNOTATION] = note
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
        inlined.append(RegionInfo(node.name, spec, ops, tuple(collectives), region_call_id(node)))
    if inlined:
        gm.graph.lint()
    return inlined
