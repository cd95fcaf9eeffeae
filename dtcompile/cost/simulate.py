"""A graph played on one device: roofline time per node, and a two-stream simulation.

Compute is estimated with a roofline: a matmul takes ``2 M N K`` flops at the
profile's ``matmul_tflops``, any other op reads and writes its tensors at its
``memory_gbps`` (views and metadata ops are free); :func:`node_time_us`.  A
``local_map`` region (one node until lowering) takes what its body takes, the
collectives it issues and waits for inside included: :func:`region_timeline`.
:func:`simulate` plays a whole graph on a compute and a communication stream
with the collective times of :mod:`dtcompile.cost`, and keeps what it played
as :class:`Span` bars (what the report's timeline and its Perfetto file draw).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from dtcompile.base.op_facts import NO_WORK, WAIT
from dtcompile.base.sizes import hint, nbytes_hint, numel_hint
from dtcompile.cost import HardwareProfile, collective_time_us
from dtcompile.graph.collectives import collective_info
from dtcompile.graph.regions import is_region, region_body

__all__ = ["Span", "Timeline", "fused_hidden_us", "node_time_us", "priced_once", "region_timeline", "simulate"]


def _tensors(value: Any) -> list[Any]:
    values = value if isinstance(value, (list, tuple)) else [value]
    return [v for v in values if isinstance(v, torch.Tensor)]


def region_timeline(node: Any, profile: HardwareProfile) -> Timeline:
    """A ``local_map`` region node played alone: its body's :func:`simulate`.

    The region ends when its body's last node does, so its collectives (issued
    and waited for inside) hold the compute stream.
    """
    return simulate(region_body(node).graph, profile)


def node_time_us(node: Any, profile: HardwareProfile) -> float:
    """Roofline estimate of one compute node of an AOT graph (0 for views, waits, non-ops;
    for a fused collective-matmul, its matmuls; for a ``local_map`` region, its body's
    whole time, inner collectives included)."""
    target = node.target
    if is_region(node):
        return region_timeline(node, profile).total_us
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return 0.0
    name = target._opname
    if target.namespace == "dtcompile":
        if name == "fused_all_gather_matmul":
            gathered, outs = node.meta["val"]
            return sum(profile.compute_time_us(2 * numel_hint(o) * hint(gathered.shape[-1])) for o in outs)
        if name == "fused_matmul_reduce_scatter":
            a, out_shape = node.args[0].meta["val"], node.args[2]
            return profile.compute_time_us(2 * math.prod(hint(s) for s in out_shape) * hint(a.shape[-1]))
    if name in NO_WORK or target.namespace == "_c10d_functional":
        return 0.0
    out = _tensors(node.meta.get("val"))
    if name in ("mm", "addmm", "bmm", "baddbmm") and out:
        a = node.args[1] if name in ("addmm", "baddbmm") else node.args[0]
        k = hint(a.meta["val"].shape[-1])
        return profile.compute_time_us(2 * numel_hint(out[0]) * k)
    moved = sum(nbytes_hint(t) for t in out)
    moved += sum(nbytes_hint(t) for a in node.all_input_nodes for t in _tensors(a.meta.get("val")))
    return profile.memory_time_us(moved)


def fused_hidden_us(comm_us: float, matmul_us: float, group_size: int, profile: HardwareProfile) -> float:
    """What a fused collective-matmul over ``group_size`` ranks hides of its collective
    (``C``) under its matmuls (``M``), pipelining ``group_size`` chunks:
    ``overlap * (min(C, M) - min(C, M) / n)``."""
    shorter = min(comm_us, matmul_us)
    return profile.overlap * (shorter - shorter / group_size)


@dataclass(frozen=True)
class Span:
    """One bar of a simulated timeline."""

    lane: str
    """``compute``: the compute stream's work; ``comm``: a collective on the communication
    stream; ``exposed``: the compute stream waiting for communication (at a wait, the
    part of a collective that holds it, the communication left after the last node)."""
    name: str
    """The node, or for merged compute the first and last node (``mm .. relu``)."""
    start_us: float
    end_us: float
    nodes: int = 1
    """How many graph nodes the bar stands for (back-to-back compute is one bar)."""


@dataclass(frozen=True)
class Timeline:
    """Estimated run of one graph: a compute stream and a communication stream."""

    compute_us: float
    """Sum of the compute nodes' estimates."""
    comm_us: float
    """Sum of the collectives' estimates."""
    total_us: float
    """When the last node finishes."""
    spans: tuple[Span, ...] = field(default=(), compare=False, repr=False)
    """The bars, in the order played (:class:`Span`)."""

    @property
    def exposed_comm_us(self) -> float:
        """Communication the compute stream waits for: ``total - compute``."""
        return self.total_us - self.compute_us


def priced_once(node: Any, profile: HardwareProfile, times: dict[Any, float]) -> float:
    """:func:`node_time_us`, kept in ``times`` (a node's time does not depend on where it runs)."""
    cost = times.get(node)
    if cost is None:
        cost = times[node] = node_time_us(node, profile)
    return cost


def simulate(
    graph: Any,
    profile: HardwareProfile,
    times: dict[Any, float] | None = None,
    infos: Mapping[Any, Any] | None = None,
) -> Timeline:
    """Play ``graph`` on one compute and one communication stream, in graph order.

    A collective is issued when the compute stream reaches it and runs after the
    previous collective; ``wait_tensor`` holds compute until it is done; other
    nodes take their roofline time.  Of a collective's time ``C``, the part the
    profile cannot overlap, ``(1 - profile.overlap) * C``, also holds the compute
    stream where it is issued (on a CPU host, gloo's threads take the cores the
    compute runs on).  A fused collective-matmul over ``n`` ranks pipelines ``n``
    chunks: it takes ``C + M - overlap * (min(C, M) - min(C, M) / n)`` on the
    compute stream for communication ``C`` and matmuls ``M`` (``max(C, M) +
    min(C, M) / n`` where communication overlaps fully).  A ``local_map`` region
    takes its body's time (:func:`region_timeline`); one that issues collectives
    starts once the communication stream is free and holds both streams.

    ``times``, where given, holds compute nodes' :func:`node_time_us` under ``profile``
    and gets those it lacks: a caller that plays one graph's nodes in several orders
    prices each node once (a node's time does not depend on where it runs).  ``infos``,
    where given, holds every collective of ``graph`` described
    (:func:`~dtcompile.graph.collectives.collective_info`), for a caller that plays one
    graph's nodes in several orders: moving nodes changes no collective.
    """
    if times is None:
        times = {}
    clock = comm_free = compute = comm = 0.0
    done: dict[Any, float] = {}
    bars = _Bars()
    for node in graph.nodes:
        info = collective_info(node) if infos is None else infos.get(node)
        if info is not None and info.fused:
            c = collective_time_us(info.op, info.bytes, info.group_size, profile.link(info.group_span))
            m = node_time_us(node, profile)
            comm += c
            compute += m
            start = max(clock, comm_free)
            bars.expose(clock, start, node.name)
            clock = start + c + m - fused_hidden_us(c, m, info.group_size, profile)
            bars.add("comm", node.name, start, start + c)
            bars.add("compute", node.name, start, start + m)
            bars.expose(start + m, clock, node.name)  # what the matmuls did not hide
        elif info is not None:
            cost = collective_time_us(info.op, info.bytes, info.group_size, profile.link(info.group_span))
            comm += cost
            start = max(clock, comm_free)
            held = (1.0 - profile.overlap) * cost  # the part that holds the compute stream
            bars.expose(clock, clock + held, node.name)
            clock += held
            comm_free = start + cost
            done[node] = comm_free
            bars.add("comm", node.name, start, comm_free)
        elif node.target is WAIT:
            ready = max(clock, done.get(node.args[0], clock))
            bars.expose(clock, ready, node.name)
            clock = ready
        elif is_region(node):
            inner = region_timeline(node, profile)
            compute += inner.compute_us
            comm += inner.comm_us
            # Its collectives queue behind the ones in flight; it ends with its body.
            start = max(clock, comm_free) if inner.comm_us else clock
            bars.expose(clock, start, node.name)
            clock = start + inner.total_us
            bars.add("compute", node.name, start, start + inner.compute_us)
            bars.expose(start + inner.compute_us, clock, node.name)  # its body's own waits
            if inner.comm_us:
                bars.add("comm", node.name, start, clock)
                comm_free = clock
        else:
            cost = priced_once(node, profile, times)
            compute += cost
            if cost:
                bars.add("compute", node.name, clock, clock + cost)
            clock += cost
    bars.expose(clock, comm_free, "end")
    return Timeline(compute, comm, max(clock, comm_free), tuple(bars.spans))


class _Bars:
    """The spans of one simulation; back-to-back compute nodes merge into one bar."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self._compute: int | None = None
        """Index of the compute bar the next compute node may extend."""

    def add(self, lane: str, name: str, start: float, end: float) -> None:
        i = self._compute
        if lane == "compute" and i is not None and abs(self.spans[i].end_us - start) < 1e-9:
            last = self.spans[i]
            first = last.name.split(" .. ")[0]
            self.spans[i] = Span(lane, f"{first} .. {name}", last.start_us, end, last.nodes + 1)
            return
        self.spans.append(Span(lane, name, start, end))
        if lane == "compute":
            self._compute = len(self.spans) - 1

    def expose(self, start: float, end: float, name: str) -> None:
        """The compute stream waits from ``start`` to ``end`` (nothing when they meet)."""
        if end - start > 1e-9:
            self.spans.append(Span("exposed", name, start, end))
            self._compute = None
