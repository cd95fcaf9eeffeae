"""The ``optimizer_updates`` pass: in a whole-step graph, each parameter's update right after its gradient.

:func:`dtcompile.compile_step` traces an optimizer's ``step()`` into the step graph
after the whole backward, its nodes marked (``node.meta["custom"][Meta.OPTIMIZER]``).
There every gradient stays alive until the optimizer runs.  This pass moves each
update node to just after the last node it must follow:

- its inputs (the gradient: for a bucketed reduce-scatter, after the bucket's wait);
- every read, outside the optimizer, of a tensor it touches (a parameter the backward
  still reads, through any view: the update writes it in place), a collective's
  read lasting until its wait (gloo and NCCL read the input in the background);
- the optimizer's earlier nodes on the same tensors, in their order: the last write of
  a tensor it reads or writes, and for a write the reads since the write before.

An update then runs while the rest of the backward and its reduce-scatters do, and
its gradient is freed once consumed.  A ``foreach`` update (one op over every
parameter) reads the last gradient too, so it stays after the backward: the pass says
so.  Nodes without inputs (a constant the optimizer makes) go just before their first
user; the profiler's ``record_function`` markers stay where they are.  The outcome
gives the graph's estimated peak before and after.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import fx

from dtcompile.base.channels import Meta
from dtcompile.passes._graph import alias_roots, read_inputs, written_args
from dtcompile.passes.context import PassContext

__all__ = ["optimizer_of", "place_optimizer_updates"]


def optimizer_of(node: fx.Node) -> str | None:
    """The optimizer (its class name) whose step traced ``node`` into the graph, or None."""
    return (node.meta.get("custom") or {}).get(Meta.OPTIMIZER)


def _is_marker(node: fx.Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "namespace", None) == "profiler"


def place_optimizer_updates(gm: fx.GraphModule, example_inputs: Sequence[Any], ctx: PassContext) -> fx.GraphModule:
    graph = gm.graph
    updates = [n for n in graph.nodes if n.op == "call_function" and optimizer_of(n) and not _is_marker(n)]
    if not updates:
        return gm
    peak_before = ctx.estimate(gm, held_bytes=0).peak_bytes
    roots = alias_roots(graph)
    moving = set(updates)
    # Every node's place as a sort key: (original position, 0, 0) for the nodes that stay;
    # an update goes after the latest node it must follow, ordered among those placed there.
    key: dict[fx.Node, tuple[float, int, float]] = {node: (i, 0, 0) for i, node in enumerate(graph.nodes)}
    last_reader: dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        if node in moving or node.op == "output":
            continue
        for source in read_inputs(node):
            last_reader[roots[source]] = node
    last_write: dict[fx.Node, fx.Node] = {}
    readers_since_write: dict[fx.Node, list[fx.Node]] = {}
    deferred: list[fx.Node] = []
    for seq, node in enumerate(updates):
        reads = {roots[source] for source in node.all_input_nodes}
        writes = {roots[target] for target in written_args(node)}  # of its inputs: within reads
        must_follow = list(node.all_input_nodes)
        must_follow += [last_reader[root] for root in reads | {roots[node]} if root in last_reader]
        # Among the optimizer's nodes: after the last write of what it reads or writes, and
        # a write after the reads since the one before (reads of one value, as every
        # parameter's of the step's bias corrections, need no order among themselves).
        must_follow += [last_write[root] for root in reads if root in last_write]
        must_follow += [reader for root in writes for reader in readers_since_write.pop(root, ())]
        for root in writes:
            last_write[root] = node
        for root in reads - writes:
            readers_since_write.setdefault(root, []).append(node)
        if not node.all_input_nodes:
            deferred.append(node)
            continue
        anchor = max(key[n] for n in must_follow)
        key[node] = (anchor[0], 1, seq)
    for node in deferred:  # just before its first user
        first = min((key[user] for user in node.users), default=key[node])
        key[node] = (first[0], 1, first[2] - 0.5) if first[1] == 1 else (first[0], -1, 0)
    order = sorted(graph.nodes, key=key.__getitem__)
    was = {node: i for i, node in enumerate(graph.nodes)}
    moved = sum(1 for i, node in enumerate(order) if node in moving and i < was[node])
    previous = None
    for node in order:
        if previous is not None and previous.next is not node:
            previous.append(node)
        previous = node
    graph.lint()
    peak_after = ctx.estimate(gm, held_bytes=0).peak_bytes
    foreach = [n.name for n in updates if _updates_many(n)]
    text = (
        f"{moved} of {len(updates)} optimizer nodes placed right after their gradients and the last reads "
        f"of what they update; estimated peak {peak_before} -> {peak_after} bytes"
    )
    ctx.moved(updates[0].name, text)
    if foreach:
        ctx.skipped(
            foreach[0],
            f"{len(foreach)} foreach update(s) take every parameter's gradient at once: they run after the "
            "last gradient (a per-parameter optimizer, foreach=False, updates each as its gradient arrives)",
        )
    return gm


def _updates_many(node: fx.Node) -> bool:
    """A foreach op (``aten._foreach_*``) over more than one tensor."""
    return (
        isinstance(node.target, torch._ops.OpOverload)
        and node.target._schema.name.startswith("aten::_foreach_")
        and any(isinstance(arg, (list, tuple)) and len(arg) > 1 for arg in node.args)
    )
