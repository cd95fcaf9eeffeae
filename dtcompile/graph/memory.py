"""The peak-memory model of a compiled graph: live bytes along its schedule.

Every tensor a graph holds lives in a storage; views (``view``, ``slice``,
``permute``, ``wait_tensor`` of a collective's buffer) share their base's.  A
storage is allocated by the first node that makes it and freed after the last
node that reads it or any view of it, in graph order (the order the graph
runs, as dtcompile's passes leave it); the graph's inputs live throughout (the
caller holds them: parameters, the batch, what the forward saved for the
backward) and so do its outputs (the forward's saved activations, the
backward's gradients).  :func:`estimate_memory` plays that over one graph and
gives its curve, its peak and what is alive there, by kind:

- ``input``: the graph's inputs (a forward's parameters and batch, a
  backward's saved activations and incoming gradients);
- ``gathered``: buffers of collectives (gathered weights, reduced gradients);
- ``output``: what the graph returns (saved for the backward, gradients);
- ``temporary``: the rest.

``held_bytes`` are bytes alive throughout that are not the graph's inputs: for
a backward, the parameters and batch its forward took and did not save
(:func:`held_during_backward`).  The estimate counts bytes as the tensors'
sizes say (no allocator rounding or fragmentation) on the graph handed to
lowering: Inductor's fusions free intermediates sooner, so a graph compiled with
Inductor peaks at most this.

:class:`PeakTracker` prices a pass's candidate rewrites against a budget: each
rewrite adds bytes over a span of the schedule, and the tracker answers the
peak that results before the graph is touched.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import fx
from torch.utils import _pytree as pytree

from dtcompile.base.channels import GraphKind
from dtcompile.base.notation import format_bytes
from dtcompile.base.op_facts import WAIT
from dtcompile.base.sizes import hint
from dtcompile.graph.collectives import is_collective

__all__ = [
    "Estimates",
    "LiveTensor",
    "MemoryBudgetError",
    "MemoryEstimate",
    "MemoryPlan",
    "PeakTracker",
    "budget_below_peak",
    "estimate_memory",
    "held_during_backward",
    "prefetch_window",
]



@dataclass(frozen=True)
class LiveTensor:
    """One storage alive at a point of the schedule."""

    name: str
    """The node that allocated it."""
    bytes: int
    kind: str
    """``input``, ``gathered``, ``output`` or ``temporary`` (see the module docstring)."""

    def __str__(self) -> str:
        return f"{self.name} ({self.kind}, {format_bytes(self.bytes)})"


@dataclass
class _Storage:
    name: str
    """The node that allocated it."""
    bytes: int
    kind: str
    start: int
    end: int
    """The last position it is alive at (inclusive)."""


@dataclass(frozen=True)
class MemoryEstimate:
    """Live bytes of one graph along its schedule, and its peak."""

    kind: str
    """The graph's :class:`~dtcompile.base.channels.GraphKind`: ``forward``, ``backward``, ``inference`` or ``step``."""
    nodes: tuple[str, ...]
    """The graph's nodes, in schedule order."""
    curve: tuple[int, ...]
    """Live bytes while each node runs (its inputs and its outputs), ``held_bytes`` included."""
    held_bytes: int
    peak_bytes: int
    peak_node: str
    at_peak: tuple[LiveTensor, ...]
    """What is alive at the peak, largest first."""
    by_kind: tuple[tuple[str, int], ...]
    """Bytes alive at the peak by kind, ``held`` first."""
    spans: dict[str, tuple[int, int, int]]
    """For each node, the storage its value lives in: ``(first, last position alive, bytes)``
    (a view's is its base's; a node of several tensors, the first's)."""

    def __str__(self) -> str:
        kinds = ", ".join(f"{format_bytes(b)} {k}" for k, b in self.by_kind if b)
        return f"peak {format_bytes(self.peak_bytes)} at {self.peak_node} ({kinds})"

    def largest(self, count: int = 5) -> str:
        """The ``count`` largest tensors alive at the peak, as a line."""
        shown = ", ".join(str(t) for t in self.at_peak[:count])
        more = len(self.at_peak) - count
        return shown + (f" and {more} more" if more > 0 else "")


def _tensors(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if value is None:
        return []
    return [v for v in pytree.tree_leaves(value) if isinstance(v, torch.Tensor)]


def _storage_key(tensor: torch.Tensor) -> object:
    from torch.multiprocessing.reductions import StorageWeakRef

    try:
        return StorageWeakRef(tensor.untyped_storage())
    except (NotImplementedError, RuntimeError):
        return id(tensor)


def _nbytes(tensor: torch.Tensor) -> int:
    try:
        return hint(tensor.untyped_storage().nbytes())
    except (NotImplementedError, RuntimeError):
        return hint(tensor.numel()) * tensor.element_size()


_Facts = dict[int, tuple[object, list[tuple[object, torch.Tensor]]]]
"""A node value's id -> the value, and each of its tensors with its storage's key."""


def _keyed_tensors(value: object, facts: _Facts | None) -> list[tuple[object, torch.Tensor]]:
    """Each tensor of ``value`` with its storage's key; kept in ``facts`` (where given) for the
    next walk of a graph whose values are the same objects."""
    if facts is not None:
        kept = facts.get(id(value))
        if kept is not None and kept[0] is value:
            return kept[1]
    keyed = [(_storage_key(t), t) for t in _tensors(value)]
    if facts is not None:
        facts[id(value)] = (value, keyed)
    return keyed


def _storages(
    graph: fx.Graph, facts: _Facts | None = None
) -> tuple[list[fx.Node], list[_Storage], dict[fx.Node, list[_Storage]]]:
    """Every storage the graph holds, with the span of the schedule it is alive for, and
    the storages each node's value lives in."""
    nodes = list(graph.nodes)
    position = {node: i for i, node in enumerate(nodes)}
    end = len(nodes) - 1
    owner: dict[object, _Storage] = {}  # storage key -> its storage
    same: dict[object, _Storage] = {}  # a wait's own fake storage -> its collective's buffer
    held: dict[fx.Node, list[_Storage]] = {}
    outputs = set()
    for node in nodes:
        if node.op == "output":
            outputs = {a for a in pytree.tree_leaves(node.args) if isinstance(a, fx.Node)}
    for node in nodes:
        if node.op == "output":
            continue
        keyed = _keyed_tensors(node.meta.get("val"), facts)
        if node.target is WAIT and isinstance(node.args[0], fx.Node):
            # wait_tensor returns its collective's buffer (its fake value does not say so).
            held[node] = held.get(node.args[0], [])
            for (key, _), storage in zip(keyed, held[node]):
                same[key] = storage
            continue
        storages = []
        for key, tensor in keyed:
            storage = same.get(key) or owner.get(key)
            if storage is None:
                kind = "input" if node.op == "placeholder" else ("gathered" if is_collective(node) else "temporary")
                start = 0 if node.op == "placeholder" else position[node]  # the caller holds inputs before
                storage = owner[key] = _Storage(node.name, _nbytes(tensor), kind, start, position[node])
            storages.append(storage)
        held[node] = storages
    # Each storage is alive up to the last node that reads a node holding it.  Read off
    # each node's last reader first: a fused optimizer's node holds every parameter's
    # storage, and each of its hundreds of getitems reads it.
    last_read: dict[fx.Node, int] = {}
    for node in nodes:
        for used in node.all_input_nodes:
            last_read[used] = position[node]  # the nodes come in order: the last is the latest
    for node in nodes:
        read = last_read.get(node)
        for storage in held.get(node, ()):
            if read is not None and read > storage.end:
                storage.end = read
            if node.op == "placeholder":
                storage.end = end
            if node in outputs:
                storage.end = end
                if storage.kind == "temporary":
                    storage.kind = "output"
    return nodes, list(owner.values()), held


def estimate_memory(
    gm: fx.GraphModule | fx.Graph, kind: GraphKind = GraphKind.FORWARD, held_bytes: int = 0, _facts: _Facts | None = None
) -> MemoryEstimate:
    """The live bytes of ``gm`` along its schedule (see the module docstring).  (``_facts``:
    :class:`Estimates`' storage keys of the values it walked before.)"""
    graph = gm.graph if isinstance(gm, fx.GraphModule) else gm
    nodes, storages, held = _storages(graph, _facts)
    delta = [0] * (len(nodes) + 1)
    for s in storages:
        delta[s.start] += s.bytes
        delta[s.end + 1] -= s.bytes
    curve, live = [], held_bytes
    for step in delta[:-1]:
        live += step
        curve.append(live)
    peak_at = max(range(len(curve)), key=curve.__getitem__) if curve else 0
    alive = sorted(
        (LiveTensor(s.name, s.bytes, s.kind) for s in storages if s.start <= peak_at <= s.end and s.bytes),
        key=lambda t: -t.bytes,
    )
    totals = {"held": held_bytes}
    for tensor in alive:
        totals[tensor.kind] = totals.get(tensor.kind, 0) + tensor.bytes
    return MemoryEstimate(
        kind=kind,
        nodes=tuple(n.name for n in nodes),
        curve=tuple(curve),
        held_bytes=held_bytes,
        peak_bytes=curve[peak_at] if curve else held_bytes,
        peak_node=nodes[peak_at].name if nodes else "",
        at_peak=tuple(alive),
        by_kind=tuple(totals.items()),
        spans={node.name: (own[0].start, own[0].end, own[0].bytes) for node, own in held.items() if own},
    )


class Estimates:
    """:func:`estimate_memory` for the passes over one graph, each estimate kept while the
    graph is as it was: asked again where no pass changed the graph since (its nodes, their
    order, targets, inputs and values the same objects), it answers the kept estimate, where
    an estimate walks every storage of the graph (the passes ask up to seven times a graph,
    most often of a graph the pass before left as it was).  A walk of a changed graph reads
    the storages of the values it walked before from what it kept of them.  Exact: what an
    estimate reads of the graph is what the kept one is compared on, and the kept objects stay
    alive while it is kept, so no identity is reused."""

    def __init__(self) -> None:
        self._kept: dict[tuple[int, str, int], tuple[tuple[int, ...], list[object], MemoryEstimate]] = {}
        self._facts: _Facts = {}  # each value walked, with its storages' keys (kept alive with it)

    def __call__(self, gm: fx.GraphModule | fx.Graph, kind: GraphKind, held_bytes: int = 0) -> MemoryEstimate:
        graph = gm.graph if isinstance(gm, fx.GraphModule) else gm
        layout, objects = _layout(graph)
        key = (id(graph), str(kind), held_bytes)
        kept = self._kept.get(key)
        if kept is not None and kept[0] == layout:
            return kept[2]
        estimate = estimate_memory(graph, kind, held_bytes, self._facts)
        self._kept[key] = (layout, [graph, *objects], estimate)
        return estimate


def _layout(graph: fx.Graph) -> tuple[tuple[int, ...], list[object]]:
    """What :func:`estimate_memory` reads of ``graph``, as identities (each node in order: the
    node, its target, its value, its inputs), and the objects behind them."""
    ids: list[int] = []
    objects: list[object] = []
    for node in graph.nodes:
        value = node.meta.get("val")
        inputs = node.all_input_nodes
        objects += (node, node.target, value)
        ids += (id(node), id(node.target), id(value), len(inputs))
        ids += map(id, inputs)
    return tuple(ids), objects


def held_during_backward(forward: fx.GraphModule, backward: fx.GraphModule) -> int:
    """Bytes the caller holds while the backward runs that are not its inputs: the storages
    of the forward's inputs (parameters, the batch) and of its results, less those the
    backward takes (a saved view of an input is that input's storage)."""
    taken = {
        _storage_key(t) for n in backward.graph.find_nodes(op="placeholder") for t in _tensors(n.meta.get("val"))
    }
    values: list[fx.Node] = list(forward.graph.find_nodes(op="placeholder"))
    output = next(iter(forward.graph.find_nodes(op="output")), None)
    if output is not None:
        values += [a for a in pytree.tree_leaves(output.args) if isinstance(a, fx.Node)]
    held = {}
    for node in values:
        for tensor in _tensors(node.meta.get("val")):
            key = _storage_key(tensor)
            if key not in taken:
                held[key] = _nbytes(tensor)
    return sum(held.values())


class LiveBytes:
    """Live bytes at each position of a schedule, under range additions and writes of a run
    of positions, with their maximum: a segment tree with lazy additions.

    ``add`` (bytes over a range of positions), ``get`` (one position) and ``max_over`` (a
    range) cost ``O(log n)``, ``assign`` (a run of positions) ``O(log n)`` and one step
    per position, and :attr:`peak` ``O(1)``: a pass that
    prices many rewrites of a window each reads and changes only that window, where
    summing a difference array over the whole schedule would cost ``O(n)`` each.  Exact:
    the bytes are integers.
    """

    def __init__(self, values: Sequence[int]) -> None:
        self.length = len(values)
        size = 1
        while size < max(self.length, 1):
            size *= 2
        self._size = size
        self._height = size.bit_length() - 1
        # _tree[p]: the max of p's leaves counting the additions at p and below it;
        # _lazy[p]: what was added to all of p's leaves, not yet in its children.
        self._tree: list[float] = [_NONE] * (2 * size)
        self._lazy: list[int] = [0] * size
        self._tree[size : size + self.length] = values
        for p in range(size - 1, 0, -1):
            self._tree[p] = max(self._tree[2 * p], self._tree[2 * p + 1])

    @property
    def peak(self) -> int:
        """The most bytes live at any position (0 for an empty schedule)."""
        return int(self._tree[1]) if self.length else 0

    def _apply(self, p: int, num: int) -> None:
        self._tree[p] += num
        if p < self._size:
            self._lazy[p] += num

    def _pull(self, p: int) -> None:
        while p > 1:
            p >>= 1
            self._tree[p] = max(self._tree[2 * p], self._tree[2 * p + 1]) + self._lazy[p]

    def _push(self, p: int) -> None:
        for shift in range(self._height, 0, -1):
            i = p >> shift
            if self._lazy[i]:
                self._apply(2 * i, self._lazy[i])
                self._apply(2 * i + 1, self._lazy[i])
                self._lazy[i] = 0

    def add(self, start: int, end: int, num: int) -> None:
        """Adds ``num`` bytes at positions ``start`` to ``end`` inclusive."""
        if not num or start > end:
            return
        lo, hi = start + self._size, end + 1 + self._size
        first, last = lo, hi - 1
        while lo < hi:
            if lo & 1:
                self._apply(lo, num)
                lo += 1
            if hi & 1:
                hi -= 1
                self._apply(hi, num)
            lo >>= 1
            hi >>= 1
        self._pull(first)
        self._pull(last)

    def max_over(self, start: int, end: int) -> int:
        """The most bytes live at positions ``start`` to ``end`` inclusive (``start <= end``)."""
        lo, hi = start + self._size, end + 1 + self._size
        self._push(lo)
        self._push(hi - 1)
        best = _NONE
        while lo < hi:
            if lo & 1:
                best = max(best, self._tree[lo])
                lo += 1
            if hi & 1:
                hi -= 1
                best = max(best, self._tree[hi])
            lo >>= 1
            hi >>= 1
        return int(best)

    def get(self, position: int) -> int:
        p = position + self._size
        self._push(p)
        return int(self._tree[p])

    def _push_over(self, lo: int, hi: int) -> None:
        """Pushes every addition above the leaves ``lo`` to ``hi`` (tree indices, ``hi``
        excluded) down to them: ``O(hi - lo + log n)``."""
        for shift in range(self._height, 0, -1):
            for i in range(lo >> shift, ((hi - 1) >> shift) + 1):
                if self._lazy[i]:
                    self._apply(2 * i, self._lazy[i])
                    self._apply(2 * i + 1, self._lazy[i])
                    self._lazy[i] = 0

    def assign(self, start: int, values: Sequence[int]) -> None:
        """Sets the bytes at positions ``start`` on to ``values``: ``O(len(values) + log n)``."""
        lo, hi = start + self._size, start + len(values) + self._size
        if lo >= hi:
            return
        self._push_over(lo, hi)
        self._tree[lo:hi] = values
        while lo > 1:
            lo, hi = lo >> 1, ((hi - 1) >> 1) + 1
            for p in range(lo, hi):
                self._tree[p] = max(self._tree[2 * p], self._tree[2 * p + 1]) + self._lazy[p]

    def copy(self) -> LiveBytes:
        other = LiveBytes.__new__(LiveBytes)
        other.__dict__.update(self.__dict__)
        other._tree, other._lazy = list(self._tree), list(self._lazy)
        return other


_NONE = float("-inf")
"""The padding positions of :class:`LiveBytes` (past the schedule's end): never the peak."""


def clipped(spans: Iterable[tuple[int, int, int]], length: int) -> list[tuple[int, int, int]]:
    """``spans`` that add bytes, cut to the positions of a schedule of ``length`` nodes."""
    cut = ((max(start, 0), min(end, length - 1), num) for start, end, num in spans if num)
    return [(start, end, num) for start, end, num in cut if start <= end]


class PeakTracker:
    """The peak of a graph's schedule as a pass plans rewrites, before it makes them.

    Positions are those of the graph's nodes when the tracker was made; a rewrite
    is a set of ``(start, end, bytes)`` spans (bytes alive from ``start`` to ``end``
    inclusive, beyond what the graph holds now; negative frees them); ``commit`` plans
    them, and a pass pricing rewrites before it plans them adds their spans to a copy of
    :attr:`live` (bucketing does).  The live bytes are a :class:`LiveBytes`: the peak is read
    in ``O(1)``, a span is committed in ``O(log n)``.  (A pass that moves nodes prices the
    moves on a :class:`~dtcompile.graph.schedule.MovingSchedule` made from :attr:`estimate`.)
    """

    def __init__(self, estimate: MemoryEstimate, budget: int) -> None:
        self.estimate = estimate
        self.budget = budget
        self.live = LiveBytes(estimate.curve)

    def span(self, node: fx.Node) -> tuple[int, int, int]:
        """``(first, last position alive, bytes)`` of the storage of ``node``'s value."""
        return self.estimate.spans.get(node.name, (0, -1, 0))

    @property
    def peak(self) -> int:
        return self.live.peak

    def commit(self, spans: Sequence[tuple[int, int, int]]) -> None:
        for start, end, num in clipped(spans, self.live.length):
            self.live.add(start, end, num)


class MemoryBudgetError(ValueError):
    """A memory budget below the least peak a graph can have."""


@dataclass(frozen=True)
class MemoryPlan:
    """What the passes of one graph may spend in bytes (``PassContext.memory``)."""

    held_bytes: int = 0
    """Bytes alive throughout that are not the graph's inputs (:func:`held_during_backward`)."""
    prefetch_bytes: int = 0
    """The default budget's window above the peak as traced (:func:`prefetch_window`)."""

    def budget_for(self, traced: MemoryEstimate, graph: str, budget_bytes: int | None) -> tuple[int, str]:
        """The budget for ``graph`` whose peak as traced is ``traced``, and where it comes
        from: ``budget_bytes`` (``DTCompileConfig.memory_budget_bytes``), or with ``None``
        that peak plus :attr:`prefetch_bytes`; a budget below that peak is a
        :class:`MemoryBudgetError`."""
        if budget_bytes is None:
            window = max(self.prefetch_bytes, 0)
            return traced.peak_bytes + window, (
                f"peak as traced {format_bytes(traced.peak_bytes)} + prefetch window {format_bytes(window)}"
            )
        if budget_bytes < traced.peak_bytes:
            raise budget_below_peak(budget_bytes, graph, traced, "its peak with no pass applied")
        return budget_bytes, "memory_budget_bytes"


def budget_below_peak(budget: int, graph: str, least: MemoryEstimate, how: str) -> MemoryBudgetError:
    """The error for ``memory_budget_bytes=budget`` below ``least``, the least peak ``graph``
    can have (``how`` says how it was found): that peak, what is alive there, and the fix."""
    return MemoryBudgetError(
        f"dtcompile: memory_budget_bytes={budget} ({format_bytes(budget)}) is below the least peak of {graph}: "
        f"{least.peak_bytes} B ({format_bytes(least.peak_bytes)}), {how}, {least}; alive there: {least.largest()}. "
        f"Raise memory_budget_bytes to at least {least.peak_bytes}, or shard more (more ranks on the "
        "data-parallel axis, reshard_after_forward=True), or make the batch smaller"
    )


def prefetch_window(gathered: dict[str, int]) -> int:
    """Twice the bytes of the largest module's gathered parameters (``gathered``:
    parameter name -> gathered bytes), grouped by module as FSDP wraps them (a block of
    a ``ModuleList``, ``layers.3``; else the top-level module, ``output``): one module
    prefetched ahead, as FSDP2 does, and the bucket buffer it is gathered or its
    gradients reduced through."""
    groups: dict[str, int] = {}
    for name, num in gathered.items():
        parts = name.split(".")
        numbered = next((i for i, part in enumerate(parts[:-1]) if part.isdigit()), None)
        group = ".".join(parts[: numbered + 1]) if numbered is not None else parts[0]
        groups[group] = groups.get(group, 0) + num
    return 2 * max(groups.values(), default=0)
