"""The placement problem as data: its nodes, each node's candidate strategies, the edges and fan-out rules between them.

:func:`~dtcompile.auto_parallel.problem.build_problem` makes a :class:`Problem`
(the candidates, :mod:`~dtcompile.auto_parallel.problem`; the edges and fan-outs,
:mod:`~dtcompile.auto_parallel.edges`), :mod:`~dtcompile.auto_parallel.tying`
groups its repeated layers, :mod:`~dtcompile.auto_parallel.solver` chooses one
candidate per node and :mod:`~dtcompile.auto_parallel.solution` explains the
choice.  Every cost is in microseconds under the problem's
:class:`~dtcompile.cost.HardwareProfile`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from dtcompile.auto_parallel.placements import Layout, PlannedCollective
from dtcompile.auto_parallel.trace import TracedModel
from dtcompile.auto_parallel.transfer import BucketKey
from dtcompile.cost import HardwareProfile

__all__ = ["Candidate", "Edge", "FanoutRule", "PNode", "Problem"]


@dataclass(frozen=True)
class Candidate:
    """One strategy of one node: the layouts it reads, gives and gets gradients in, and its cost."""

    inputs: tuple[Layout, ...]
    """Per tensor argument, the layout the node reads it in."""
    outputs: tuple[Layout | None, ...]
    """Per output, the layout it gives (``None``: not a tensor)."""
    grads: tuple[Layout | None, ...] = ()
    """Per tensor argument, the layout of the gradient it hands back (``None``: none)."""
    grad_out: tuple[Layout | None, ...] = ()
    """Per output, the layout its gradient must reach it in (``None``: none flows back)."""
    forward_us: float = 0.0
    backward_us: float = 0.0
    collectives: tuple[PlannedCollective, ...] = ()
    """Collectives inside the node (DTensor's, in its backward)."""
    comm_us: float = 0.0
    local: str = ""
    """Empty where DTensor runs the op; else how it runs on each rank's local shards
    (:mod:`dtcompile.auto_parallel.local_ops`: ``borrowed`` or ``replicated``)."""
    saved: tuple[bool, ...] = ()
    """Per tensor argument, whether its backward reads it (empty: not measured, as for a
    region, whose body is not: taken as read)."""
    saved_outputs: tuple[bool, ...] = ()
    """Per output, whether its own backward reads it (empty: none)."""
    saved_bytes: int = 0
    """Bytes per rank its backward reads that it made itself (outputs included), kept
    from the forward to the backward."""

    @property
    def cost_us(self) -> float:
        return self.forward_us + self.backward_us + self.comm_us


@dataclass
class PNode:
    """One node of the problem."""

    name: str
    kind: str
    """``param``, ``buffer``, ``input``, ``constant``, ``op``, ``region``, ``fanout`` or ``output``."""
    inputs: list[tuple[str, int]]
    """Per tensor argument, the value it reads: ``(producer, output index)``."""
    outputs: list[tuple[tuple[int, ...], torch.dtype] | None]
    """Per output, its global shape and dtype."""
    requires_grad: list[bool]
    """Per output, whether a gradient flows back into it."""
    candidates: list[Candidate]
    target: str = ""
    """What the node computes, for explanations (``aten.mm``)."""
    fx_node: fx.Node | None = None
    group: str = ""
    """Nodes of one group share one choice (tied repeated layers); the group's name is its first node's."""


@dataclass
class Edge:
    """A value's trip from its producer to one consumer: cost per (producer, consumer) candidate pair."""

    producer: str
    index: int
    consumer: str
    slot: int
    cost: Any
    """``cost[i][j]``: producer candidate ``i``, consumer candidate ``j`` (``inf``: impossible)."""
    buckets: list[list[tuple[BucketKey, ...]]] | None = None
    """For an edge out of a parameter: per pair, the buckets its collectives join
    (their launch latency is paid once per bucket, not in ``cost``)."""
    regather: bool = False
    """A parameter resharded after forward (or a view of one, ``t(w)``) that the backward
    reads: where the edge gathers it, the backward gathers it again (:func:`dtcompile.auto_parallel.transfer.transfer`)."""


@dataclass
class FanoutRule:
    """A fan-out's choice must suit a consumer's: ``ok[f][j]`` for fan-out candidate ``f``, consumer candidate ``j``."""

    fanout: str
    consumer: str
    slot: int
    ok: list[list[bool]]


@dataclass
class Problem:
    mesh: Any
    profile: HardwareProfile
    nodes: dict[str, PNode]
    edges: list[Edge]
    fanout_rules: list[FanoutRule]
    traced: TracedModel
    param_bytes: dict[str, list[int]] = field(default_factory=dict)
    """Parameter node -> its bytes per rank under each candidate."""
    bucket_cap_bytes: int | None = 256 * 1024 * 1024
    """The ``bucket_cap_bytes`` of the config the model will be compiled with: how many bytes one
    bucket takes; ``None`` where that config disables the ``bucketing`` pass."""
    seconds: dict[str, float] = field(default_factory=dict)
    """Where building took its time: ``trace``, ``strategies``, ``measure``, ``edges``."""
    measurements: dict[str, int] = field(default_factory=dict)
    """``made``: candidates measured for this problem; ``reused``: found measured already (by an
    earlier node with the same signature, or an earlier plan on a mesh like this one)."""
    regathered: frozenset[str] = frozenset()
    """Parameter nodes the compile config reshards after forward (:func:`dtcompile.pipeline.reshard.resharded`):
    gathered again in the backward where the backward reads them (``Edge.regather``)."""

    def groups(self) -> dict[str, list[str]]:
        found: dict[str, list[str]] = {}
        for node in self.nodes.values():
            found.setdefault(node.group, []).append(node.name)
        return found
