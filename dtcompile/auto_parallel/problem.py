"""The placement problem: every node's candidate strategies and what each costs, with the edges between them.

Built from the traced forward (:mod:`dtcompile.auto_parallel.trace`):

- a **parameter**, **buffer** or **input** may take any even layout
  (:func:`~dtcompile.auto_parallel.placements.layouts`; buffers replicated), or
  the layout the caller fixed;
- an **op** takes DTensor's own strategies for it
  (:func:`~dtcompile.auto_parallel.strategies.op_strategies`, fed every layout
  its inputs could arrive in), each measured forward and backward
  (:func:`~dtcompile.auto_parallel.measure.measure_op`: the roofline of its
  local ops, the collectives DTensor issues in its backward, and the layouts its
  inputs' gradients come out in);
- a **constant** (a tensor made in the model from no input: a causal mask) is
  made whole on every rank, replicated;
- an **output** takes any even layout, or the fixed one; the gradient of an output
  is taken to arrive in the output's layout;
- a **fan-out** stands for a value several nodes consume: the applied model
  redistributes it once (one ``redistribute`` node whose backward sums the
  consumers' gradients and redistributes the sum once), so its consumers must
  agree on the layout they read it in and on the layout of their gradients.  Its
  candidates are those ``(layout, gradient layout)`` pairs.

An **edge** carries a value from its producer to one consumer (or its fan-out):
the forward ``redistribute`` from the producer's output layout to the layout the
consumer's strategy reads, and the backward one of the gradient back
(:func:`~dtcompile.auto_parallel.measure.plan_redistribution`).  An edge is
impossible where it would need to *make* a ``Partial`` value (``redistribute``
cannot), or where a ``Partial`` value's gradient would stay ``Partial`` (its
producer's backward was measured with a replicated gradient).

Every cost is in microseconds under one :class:`~dtcompile.cost_model.HardwareProfile`.
"""

from __future__ import annotations

import math
import operator
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx
from torch.distributed.tensor import Partial, Replicate

from dtcompile.auto_parallel.measure import _TensorSlot, measure_op, plan_redistribution
from dtcompile.auto_parallel.placements import Layout, PlannedCollective, grad_layout, layouts, local_numel
from dtcompile.auto_parallel.strategies import UnsupportedOp, op_strategies
from dtcompile.auto_parallel.trace import TracedModel
from dtcompile.cost_model import HardwareProfile
from dtcompile.simulate import node_time_us

__all__ = ["Candidate", "Edge", "Link", "PNode", "Problem", "build_problem", "transfer"]

INF = math.inf


@dataclass(frozen=True)
class Candidate:
    """One strategy of one node: the layouts it reads, gives and gets gradients in, and its cost."""

    inputs: tuple[Layout, ...]
    """Per tensor argument, the layout the node reads it in."""
    outputs: tuple[Layout | None, ...]
    """Per output, the layout it gives (``None``: not a tensor)."""
    grads: tuple[Layout | None, ...] = ()
    """Per tensor argument, the layout of the gradient it hands back (``None``: none)."""
    forward_us: float = 0.0
    backward_us: float = 0.0
    collectives: tuple[PlannedCollective, ...] = ()
    """Collectives inside the node (DTensor's, in its backward)."""
    comm_us: float = 0.0

    @property
    def cost_us(self) -> float:
        return self.forward_us + self.backward_us + self.comm_us


@dataclass
class PNode:
    """One node of the problem."""

    name: str
    kind: str
    """``param``, ``buffer``, ``input``, ``constant``, ``op``, ``fanout`` or ``output``."""
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


@dataclass
class Link:
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
    links: list[Link]
    traced: TracedModel
    param_bytes: dict[str, list[int]] = field(default_factory=dict)
    """Parameter node -> its bytes per rank under each candidate."""
    seconds: dict[str, float] = field(default_factory=dict)
    """Where building took its time: ``trace``, ``strategies``, ``measure``, ``edges``."""

    def groups(self) -> dict[str, list[str]]:
        found: dict[str, list[str]] = {}
        for node in self.nodes.values():
            found.setdefault(node.group, []).append(node.name)
        return found


@dataclass(frozen=True)
class Transfer:
    """One edge under one pair of candidates: its collectives and their time."""

    collectives: tuple[PlannedCollective, ...]
    time_us: float


def transfer(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    out: Layout | None,
    read: Layout,
    grad: Layout | None,
    mesh: Any,
    profile: HardwareProfile,
    cache: dict[Any, Transfer | None],
) -> Transfer | None:
    """The forward redistribution ``out -> read`` and, when ``grad`` is given, the backward
    one ``grad -> grad_layout(grad, out)``; ``None`` where impossible (see the module docstring)."""
    key = (shape, dtype, out, read, grad)
    if key in cache:
        return cache[key]
    result: Transfer | None
    if out is None or any(isinstance(r, Partial) and r != o for r, o in zip(read, out)):
        result = None
    elif grad is not None and any(isinstance(g, Partial) and isinstance(o, Partial) for g, o in zip(grad, out)):
        result = None
    else:
        found = plan_redistribution(shape, dtype, out, read, mesh, "forward")
        if grad is not None:
            found += plan_redistribution(shape, dtype, grad, grad_layout(grad, out), mesh, "backward")
        result = Transfer(found, sum(c.time_us(profile) for c in found))
    cache[key] = result
    return result


def _tensor_meta(value: Any) -> tuple[tuple[int, ...], torch.dtype] | None:
    if isinstance(value, torch.Tensor):
        return tuple(int(s) for s in value.shape), value.dtype
    return None


def _out_metas(node: fx.Node) -> list[tuple[tuple[int, ...], torch.dtype] | None]:
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        return [_tensor_meta(v) for v in val]
    return [_tensor_meta(val)]


def _op_text(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._opname}"
    return getattr(target, "__name__", str(target))


def _resolve(node: fx.Node) -> tuple[fx.Node, int]:
    """The value an argument reads: ``getitem(x, k)`` reads output ``k`` of ``x``."""
    if node.op == "call_function" and node.target is operator.getitem:
        return node.args[0], node.args[1]
    return node, 0


class _Builder:
    def __init__(self, traced: TracedModel, mesh: Any, profile: HardwareProfile, fixed: Mapping[str, Layout]) -> None:
        self.traced, self.mesh, self.profile, self.fixed = traced, mesh, profile, fixed
        self.nodes: dict[str, PNode] = {}
        self.measures: dict[Any, Candidate] = {}
        self.transfers: dict[Any, Transfer | None] = {}
        self.seconds = {"strategies": 0.0, "measure": 0.0, "edges": 0.0}

    def _layouts_for(self, name: str, shape: tuple[int, ...]) -> list[Layout]:
        if name in self.fixed:
            return [tuple(self.fixed[name])]
        return layouts(shape, self.mesh.shape)

    def placeholders(self) -> None:
        t = self.traced
        kinds = [(n, node, "param") for n, node in t.params] + [(n, node, "buffer") for n, node in t.buffers]
        kinds += [(f"input{i}", node, "input") for i, node in enumerate(t.inputs)]
        for label, node, kind in kinds:
            meta = _tensor_meta(node.meta.get("val"))
            if meta is None:
                raise ValueError(f"auto_parallel: {label} is not a tensor; only tensor inputs are supported")
            shape = meta[0]
            options = [tuple([Replicate()] * self.mesh.ndim)] if kind == "buffer" else self._layouts_for(label, shape)
            if not options:
                raise ValueError(f"auto_parallel: no layout of {label} (shape {list(shape)}) shards evenly over mesh {tuple(self.mesh.shape)}")
            rg = t.requires_grad[node.name]
            self.nodes[node.name] = PNode(
                node.name, kind, [], [meta], [rg], [Candidate((), (layout,)) for layout in options],
                target=label, fx_node=node, group=node.name,
            )

    def is_constant(self, node: fx.Node) -> bool:
        ins = [_resolve(a)[0] for a in node.all_input_nodes]
        return all(self.nodes[a.name].kind == "constant" for a in ins if a.name in self.nodes)

    def call(self, node: fx.Node) -> None:
        metas = _out_metas(node)
        if all(m is None for m in metas):
            raise ValueError(f"auto_parallel: node {node.name} ({node.target}) makes no tensor; not supported")
        tensor_args = [a for a in pytree.tree_leaves((node.args, node.kwargs)) if isinstance(a, fx.Node)]
        if self.is_constant(node):
            time_us = node_time_us(node, self.profile)
            rep = tuple([Replicate()] * self.mesh.ndim)
            self.nodes[node.name] = PNode(
                node.name, "constant", [_ref(a) for a in tensor_args], metas, [False] * len(metas),
                [Candidate((rep,) * len(tensor_args), tuple(rep if m else None for m in metas), forward_us=time_us)],
                target=_op_text(node.target), fx_node=node, group=node.name,
            )
            return
        refs = [_ref(a) for a in tensor_args]
        slots = iter(range(len(tensor_args)))
        args, kwargs = pytree.tree_map_only(fx.Node, lambda _: _TensorSlot(next(slots)), (node.args, node.kwargs))
        in_metas = [self.nodes[p].outputs[k] for p, k in refs]
        in_rg = [self.nodes[p].requires_grad[k] for p, k in refs]
        options = []
        for (p, k), (shape, _) in zip(refs, in_metas):
            produced = [c.outputs[k] for c in self.nodes[p].candidates if c.outputs[k] is not None]
            options.append(list(dict.fromkeys(produced + layouts(shape, self.mesh.shape))))
        start = time.perf_counter()
        try:
            strategies = op_strategies(
                node.target, args, kwargs, in_metas, options, [m[0] if m else None for m in metas], self.mesh
            )
        except UnsupportedOp as e:
            raise ValueError(f"auto_parallel: node {node.name}: {e}; the model uses an op DTensor cannot shard") from None
        self.seconds["strategies"] += time.perf_counter() - start
        if not strategies:
            raise ValueError(
                f"auto_parallel: node {node.name} ({_op_text(node.target)}): DTensor lists no strategy that "
                f"shards its tensors evenly over mesh {tuple(self.mesh.shape)}"
            )
        start = time.perf_counter()
        candidates = []
        signature = (node.target, repr((args, kwargs)), tuple(in_metas), tuple(in_rg))
        for ins, outs in strategies:
            key = (signature, ins, outs)
            if key not in self.measures:
                m = measure_op(
                    node.target, args, kwargs, [(s, d, rg) for (s, d), rg in zip(in_metas, in_rg)], ins, metas, outs,
                    self.mesh, self.profile, self.traced.fake_mode,
                )
                if any(o is not None and g != o for g, o in zip(m.out_layouts, outs)):
                    self.measures[key] = None
                    continue
                self.measures[key] = Candidate(
                    ins, outs, m.grad_layouts, m.forward_us, m.backward_us, m.collectives,
                    sum(c.time_us(self.profile) for c in m.collectives),
                )
            if self.measures[key] is not None:
                candidates.append(self.measures[key])
        self.seconds["measure"] += time.perf_counter() - start
        out_rg = [bool(m is not None and m[1].is_floating_point and any(in_rg)) for m in metas]
        self.nodes[node.name] = PNode(
            node.name, "op", refs, metas, out_rg, candidates, target=_op_text(node.target), fx_node=node, group=node.name
        )

    def outputs(self, output_layouts: Mapping[int, Layout]) -> None:
        (out_args,) = [n for n in self.traced.gm.graph.nodes if n.op == "output"][0].args
        for i, arg in enumerate(out_args):
            if not isinstance(arg, fx.Node):
                raise ValueError(f"auto_parallel: output {i} is not a tensor; only tensor outputs are supported")
            p, k = _ref(arg)
            meta = self.nodes[p].outputs[k]
            options = [tuple(output_layouts[i])] if i in output_layouts else layouts(meta[0], self.mesh.shape)
            rg = self.nodes[p].requires_grad[k]
            name = f"output{i}"
            self.nodes[name] = PNode(
                name, "output", [(p, k)], [meta], [False],
                [Candidate((layout,), (layout,), (layout if rg else None,)) for layout in options],
                target="output", group=name,
            )


def _ref(arg: fx.Node) -> tuple[str, int]:
    node, index = _resolve(arg)
    return node.name, index


def _consumers(nodes: Mapping[str, PNode]) -> dict[tuple[str, int], list[tuple[str, int]]]:
    found: dict[tuple[str, int], list[tuple[str, int]]] = {}
    for node in nodes.values():
        for slot, ref in enumerate(node.inputs):
            if node.kind != "constant":
                found.setdefault(ref, []).append((node.name, slot))
    return found


def _edges(b: _Builder) -> tuple[list[Edge], list[Link]]:
    """Edges for single consumers; a fan-out node, its edge and its links for shared values."""
    edges, links = [], []
    for (p, k), users in _consumers(b.nodes).items():
        producer = b.nodes[p]
        shape, dtype = producer.outputs[k]
        rg = producer.requires_grad[k]

        def cost_matrix(consumer: PNode, slot: int) -> list[list[float]]:
            rows = []
            for pc in producer.candidates:
                row = []
                for cc in consumer.candidates:
                    grad = cc.grads[slot] if rg and cc.grads else None
                    t = transfer(shape, dtype, pc.outputs[k], cc.inputs[slot], grad, b.mesh, b.profile, b.transfers)
                    row.append(INF if t is None else t.time_us)
                rows.append(row)
            return rows

        if len(users) == 1:
            c, slot = users[0]
            edges.append(Edge(p, k, c, slot, cost_matrix(b.nodes[c], slot)))
            continue
        pairs: dict[tuple[Layout, Layout | None], None] = {}
        for c, slot in users:
            for cc in b.nodes[c].candidates:
                pairs[(cc.inputs[slot], cc.grads[slot] if rg and cc.grads else None)] = None
        name = f"{p}_fanout{k}" if k else f"{p}_fanout"
        fan = PNode(
            name, "fanout", [(p, k)], [(shape, dtype)], [rg],
            [Candidate((t,), (t,), (g,)) for t, g in pairs], target="fanout", group=name,
        )
        b.nodes[name] = fan
        edges.append(Edge(p, k, name, 0, cost_matrix(fan, 0)))
        for c, slot in users:
            consumer = b.nodes[c]
            ok = [
                [cc.inputs[slot] == fc.inputs[0] and (fc.grads[0] is None or cc.grads[slot] in (None, fc.grads[0]))
                 for cc in consumer.candidates]
                for fc in fan.candidates
            ]
            links.append(Link(name, c, slot, ok))
    return edges, links


def build_problem(
    traced: TracedModel,
    mesh: Any,
    profile: HardwareProfile,
    *,
    fixed: Mapping[str, Layout] | None = None,
    output_layouts: Mapping[int, Layout] | None = None,
) -> Problem:
    """The problem for ``traced`` on ``mesh``; ``fixed`` pins parameters (by name) or
    inputs (``input0``...) to one layout, ``output_layouts`` pins outputs by position."""
    b = _Builder(traced, mesh, profile, dict(fixed or {}))
    b.placeholders()
    for node in traced.gm.graph.nodes:
        if node.op == "call_function" and node.target is not operator.getitem:
            b.call(node)
        elif node.op == "get_attr":
            raise ValueError(f"auto_parallel: the model reads the tensor attribute {node.target}; make it a buffer")
    b.outputs(dict(output_layouts or {}))
    start = time.perf_counter()
    edges, links = _edges(b)
    b.seconds["edges"] = time.perf_counter() - start
    param_bytes = {}
    for _, node in traced.params:
        pnode = b.nodes[node.name]
        shape, dtype = pnode.outputs[0]
        param_bytes[node.name] = [local_numel(shape, c.outputs[0], mesh.shape) * dtype.itemsize for c in pnode.candidates]
    return Problem(mesh, profile, b.nodes, edges, links, traced, param_bytes, b.seconds)
