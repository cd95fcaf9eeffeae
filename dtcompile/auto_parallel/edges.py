"""The edges of the placement problem: what carrying each value from its producer to its readers costs, and the fan-outs of shared values.

An **edge** carries a value from its producer to one consumer (or its fan-out):
the forward ``redistribute`` from the producer's output layout to the layout the
consumer's strategy reads, and the backward one of the gradient back
(:func:`~dtcompile.auto_parallel.transfer.transfer`).  The
collectives of an edge out of a parameter (its all-gather, its gradient's
reduction) wait for no activation, and dtcompile's ``bucketing`` pass merges
them per kind and mesh axis into one collective (up to ``bucket_cap_bytes``):
such an edge costs its bytes on the wire, and each bucket its launch latency once
(:func:`~dtcompile.auto_parallel.transfer.bucketed_time_us`; the solver adds one
variable per bucket).  A reader that takes the value as it is (same layout, its
gradient coming back as the producer's candidate wants it) costs nothing and
needs no ``redistribute``.  An edge is impossible where it would need to *make*
a ``Partial`` value (``redistribute`` cannot), or where the gradient would reach
the producer in another layout than the one its backward was measured with.

A parameter the compile config reshards after forward (or a view of one,
``t(w)``) that the backward reads is gathered again in the backward where its
edge gathers it (``Edge.regather``; the backward reads a value where any of its
readers' candidates saves it, or through a view whose result it reads).

A **fan-out** stands for a value several nodes consume: the applied model
redistributes it once (one ``redistribute`` node whose backward sums the
consumers' gradients and redistributes the sum once), so its consumers must
agree on the layout they read it in and on the layout of their gradients.  Its
candidates are those ``(layout, gradient layout)`` pairs; one edge carries the
value to it, and a :class:`~dtcompile.auto_parallel.graph.FanoutRule` per
consumer says which of its candidates suit which of the consumer's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from dtcompile.auto_parallel.graph import Candidate, Edge, FanoutRule, PNode
from dtcompile.auto_parallel.placements import Layout
from dtcompile.auto_parallel.trace import source_line
from dtcompile.auto_parallel.transfer import Transfer, bucketed_time_us, transfer
from dtcompile.base.op_facts import GRADIENT_PASSTHROUGH
from dtcompile.cost import HardwareProfile

__all__ = ["build_edges", "view_origin"]

INF = math.inf


def _read_in_backward(nodes: Mapping[str, PNode], consumers: Mapping[tuple[str, int], list[tuple[str, int]]]) -> Callable[[str, int], bool]:
    """Whether the backward reads what node ``name`` reads as argument ``slot`` (any of its
    candidates saves it, or the node is a view whose result the backward reads)."""
    memo: dict[tuple[str, int], bool] = {}

    def read(name: str, slot: int) -> bool:
        if (name, slot) not in memo:
            node = nodes[name]
            if node.kind == "output":
                found = False
            elif any(not c.saved or c.saved[slot] for c in node.candidates):
                found = True
            else:
                view = node.kind == "op" and node.target.rpartition(".")[2] in GRADIENT_PASSTHROUGH
                found = view and any(read(c, s) for c, s in consumers.get((name, 0), ()))
            memo[(name, slot)] = found
        return memo[(name, slot)]

    return read


def view_origin(nodes: Mapping[str, PNode], name: str) -> PNode:
    """The node ``name`` is a view of, through views of one value (``t(w)``: ``w``), or itself."""
    node = nodes[name]
    while node.kind == "op" and node.target.rpartition(".")[2] in GRADIENT_PASSTHROUGH and len(node.inputs) == 1:
        node = nodes[node.inputs[0][0]]
    return node


def _param_of(nodes: Mapping[str, PNode], name: str) -> str | None:
    """The parameter node ``name`` is, or is a view of (``t(w)``), else ``None``."""
    node = view_origin(nodes, name)
    return node.name if node.kind == "param" else None


def _consumers(nodes: Mapping[str, PNode]) -> dict[tuple[str, int], list[tuple[str, int]]]:
    found: dict[tuple[str, int], list[tuple[str, int]]] = {}
    for node in nodes.values():
        for slot, ref in enumerate(node.inputs):
            if node.kind != "constant":
                found.setdefault(ref, []).append((node.name, slot))
    return found


def build_edges(
    nodes: dict[str, PNode], mesh: Any, profile: HardwareProfile, bucket_cap_bytes: int | None,
    regathered: frozenset[str], transfers: dict[Any, Transfer | None] | None = None,
) -> tuple[list[Edge], list[FanoutRule]]:
    """Edges for single consumers; a fan-out node (added to ``nodes``), its edge and its rules
    for shared values.  ``bucket_cap_bytes`` and ``regathered`` are the
    :class:`~dtcompile.auto_parallel.graph.Problem`'s; ``transfers``: the priced transfers on
    this mesh under this profile, kept across plans (filled here)."""
    edges, rules = [], []
    transfers = {} if transfers is None else transfers
    consumers = _consumers(nodes)
    read = _read_in_backward(nodes, consumers)
    # Repeated layers share their nodes' candidate lists (:mod:`~dtcompile.auto_parallel.problem`
    # answers a repeated question once), so their edges' prices are the same: priced once.
    priced_edges: dict[Any, tuple[Any, Any]] = {}
    fanout_candidates: dict[Any, list[Candidate]] = {}
    suits: dict[tuple[int, int, int], list[list[bool]]] = {}  # (fan-out's, reader's candidates, slot) -> ok
    for (p, k), users in consumers.items():
        producer = nodes[p]
        shape, dtype = producer.outputs[k]
        rg = producer.requires_grad[k]

        # A parameter's all-gather waits for nothing, its gradient's reduction is the last
        # use of that gradient: dtcompile's bucketing merges them (not so for a collective
        # on a value computed in the graph, even from parameters alone: its input is ready
        # late, or its result is read at once).
        bucketed = producer.kind == "param" and bucket_cap_bytes is not None
        regather = _param_of(nodes, p) in regathered and any(read(c, slot) for c, slot in users)

        def edge(consumer: PNode, slot: int) -> Edge:
            key = (id(producer.candidates), k, id(consumer.candidates), slot, shape, dtype, rg, bucketed, regather)
            if key not in priced_edges:
                priced_edges[key] = prices(consumer, slot)
            rows, buckets = priced_edges[key]
            return _checked(Edge(p, k, consumer.name, slot, rows, buckets, regather), producer, consumer)

        def prices(consumer: PNode, slot: int) -> tuple[Any, Any]:
            # A pair's price depends only on what the producer gives (and wants back) and what
            # the consumer reads (and hands back): priced once per distinct such pair.
            gives = [(pc.outputs[k], pc.grad_out[k] if pc.grad_out else None) for pc in producer.candidates]
            reads = [(cc.inputs[slot], cc.grads[slot] if rg and cc.grads else None) for cc in consumer.candidates]
            priced: dict[tuple[Any, Any], tuple[float, tuple[Any, ...]]] = {}
            for give in dict.fromkeys(gives):
                for take in dict.fromkeys(reads):
                    t = transfer(shape, dtype, give[0], give[1], take[0], take[1], mesh, profile, transfers, regather)
                    if t is None:
                        priced[give, take] = (INF, ())
                    elif bucketed:
                        priced[give, take] = bucketed_time_us(t, profile, bucket_cap_bytes)
                    else:
                        priced[give, take] = (t.time_us, ())
            rows = [[priced[give, take][0] for take in reads] for give in gives]
            buckets = [[priced[give, take][1] for take in reads] for give in gives] if bucketed else None
            return rows, buckets

        if len(users) == 1:
            c, slot = users[0]
            edges.append(edge(nodes[c], slot))
            continue
        pairs: dict[tuple[Layout, Layout | None], None] = {}
        for c, slot in users:
            for cc in nodes[c].candidates:
                pairs[(cc.inputs[slot], cc.grads[slot] if rg and cc.grads else None)] = None
        name = f"{p}_fanout{k}" if k else f"{p}_fanout"
        options = tuple(pairs)
        if options not in fanout_candidates:
            fanout_candidates[options] = [Candidate((t,), (t,), (g,), (g,)) for t, g in options]
        fan = PNode(name, "fanout", [(p, k)], [(shape, dtype)], [rg], fanout_candidates[options], target="fanout", group=name)
        nodes[name] = fan
        edges.append(edge(fan, 0))
        for c, slot in users:
            consumer = nodes[c]
            # Shared candidate lists (repeated layers): the same matrix, made once.
            key = (id(fan.candidates), id(consumer.candidates), slot)
            if key not in suits:
                suits[key] = [
                    [cc.inputs[slot] == fc.inputs[0] and (fc.grads[0] is None or cc.grads[slot] in (None, fc.grads[0]))
                     for cc in consumer.candidates]
                    for fc in fan.candidates
                ]
            rules.append(FanoutRule(name, c, slot, suits[key]))
    return edges, rules


def _checked(edge: Edge, producer: PNode, consumer: PNode) -> Edge:
    """``edge``, after checking its cost matrix is one row per producer candidate and one column
    per consumer candidate, with at least one possible pair (the solver relies on both)."""
    rows, cols = len(producer.candidates), len(consumer.candidates)
    where = f"auto_parallel: the edge {producer.name} -> {consumer.name} (argument {edge.slot})"
    if not rows or not cols:
        empty = producer if not rows else consumer
        raise ValueError(f"{where}: node {empty.name} ({empty.target}) has no candidate strategy; please report this")
    if len(edge.cost) != rows or any(len(row) != cols for row in edge.cost):
        shape = (len(edge.cost), sorted({len(row) for row in edge.cost}))
        raise ValueError(f"{where}: its cost matrix is {shape}, not ({rows}, {cols}); please report this")
    if all(math.isinf(c) for row in edge.cost for c in row):
        raise ValueError(
            f"{where}: no layout {producer.name} can give ({producer.target}) is one {consumer.name} "
            f"({consumer.target}{source_line(consumer.fx_node)}) can read, "
            f"with its gradient coming back as {producer.name} needs it; "
            "pin the parameters and inputs around it with fixed=..., or wrap the code in dtcompile.local_map"
        )
    return edge
