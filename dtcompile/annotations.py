"""Placements and communication, node by node, at both levels dtcompile sees.

Dynamo level (DTensor ops, before AOTAutograd): every node whose value is a
DTensor, or whose arguments are, gets a :class:`NodePlacement` in the op-schema
notation of DTensor's own ``OpSchema``::

    linear = torch._C._nn.linear(Spec(f32[8, 16](R)), Spec(f32[32, 16](S(0)))) -> Spec(f32[8, 32](S(1)))

AOT level (local ops and functional collectives): every call node gets
``node.meta["dtcompile_annotation"]``: a collective's kind, mesh axis, group
size, bytes per rank and estimated time under the cost profile; any other node
the Dynamo node it was traced from (``meta["from_node"]``; for a backward node,
the forward node with the same autograd sequence number) and that node's
output placement.  The collectives are also charged to their Dynamo node, so the
Dynamo-level text shows which DTensor op communicates, in forward and backward.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

from dtcompile.base.channels import GraphKind, Meta
from dtcompile.base.notation import describe_mesh, real_object
from dtcompile.cost import HardwareProfile, collective_time_us
from dtcompile.graph.collectives import CollectiveInfo, collective_info
from dtcompile.graph.rank_dependence import uneven_sharding
from dtcompile.hops.region_op import region_call_id
from dtcompile.spmd.inference import format_types, type_graph

__all__ = [
    "Communication",
    "DynamoGraphInfo",
    "NodePlacement",
    "annotate_aot_graph",
    "charge_collective",
    "describe_dynamo_graph",
    "format_aot_graph",
]


@dataclass(frozen=True)
class NodePlacement:
    """One Dynamo node's DTensor view: inputs and output in ``Spec(...)`` notation."""

    name: str
    target: str
    args: tuple[str, ...]
    output: str
    mesh: str

    def __str__(self) -> str:
        arrow = f" -> {self.output}" if self.output else ""
        return f"{self.name} = {self.target}({', '.join(self.args)}){arrow}"


@dataclass(frozen=True)
class Communication:
    """A collective issued on behalf of a Dynamo node."""

    kind: GraphKind
    """The graph that issues it: ``forward``, ``backward``, ``inference`` or ``step`` (a whole-step graph)."""
    collective: CollectiveInfo
    time_us: float

    def __str__(self) -> str:
        return f"{self.kind} {self.collective.short} ~{self.time_us:.1f} us"


@dataclass
class DynamoGraphInfo:
    """What dtcompile learned about one Dynamo graph (one compile id)."""

    compile_id: str
    axes: dict[str, str]
    profile: HardwareProfile
    profile_why: str = "given"
    """Why this profile (:class:`dtcompile.cost.ProfileChoice`): given, or what ``auto`` read."""
    nodes: dict[str, NodePlacement] = field(default_factory=dict)
    """The DTensor nodes (a DTensor in or out), by name, in graph order."""
    node_names: frozenset[str] = frozenset()
    """Every node of the Dynamo graph (the provenance of AOT nodes names one)."""
    meshes: tuple[str, ...] = ()
    seq_nr_to_node: dict[int, str] = field(default_factory=dict)
    region_calls: dict[int, str] = field(default_factory=dict)
    """A forward ``local_map`` region's call id -> its Dynamo node (its backward region has the same id)."""
    communication: dict[str, list[Communication]] = field(default_factory=lambda: defaultdict(list))
    spmd_inputs: tuple[dict[str, str] | None, ...] = ()
    """Each graph input's SPMD type per mesh axis (:func:`dtcompile.spmd.inference.input_types`); ``()`` if none is typed."""
    spmd_forward: dict[str, dict[str, str]] = field(default_factory=dict)
    """The forward graph's nodes' SPMD types by name, and its outputs' (the backward starts from them)."""
    spmd_forward_outputs: list[dict[str, str] | None] = field(default_factory=list)
    step_parts: dict[str, str] = field(default_factory=dict)
    """A whole-step graph's nodes (by name) -> the part of the step each is in, with the
    code it was traced from (``forward at model.py:42``); empty for other graphs."""
    uneven: tuple[str, ...] = ()
    """DTensors sharded unevenly (or over a symbolic size): ranks hold shards of other
    shapes, so their AOT graphs can differ (padding on some ranks, empty shards)."""

    def format(self) -> str:
        """The annotated Dynamo graph, one line per DTensor node, with what it communicates."""
        lines = [f"on {mesh}" for mesh in self.meshes]
        for name, note in self.nodes.items():
            line = str(note)
            comm = self.communication.get(name)
            if comm:
                line += "  # " + "; ".join(str(c) for c in comm)
            lines.append(line)
        unattributed = [c for name, cs in self.communication.items() if name not in self.nodes for c in cs]
        lines += [f"(no DTensor op) # {c}" for c in unattributed]
        return "\n".join(lines)


def _spec(value: Any) -> str | None:
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return str(value._spec)
    return None


def _mesh_text(value: Any) -> str | None:
    """``DeviceMesh((tp=4))`` for a mesh, or the trace-time fake of one; else None."""
    from torch.distributed.device_mesh import DeviceMesh

    real = real_object(value)
    return describe_mesh(real) if isinstance(real, DeviceMesh) else None


def _arg_text(arg: Any) -> str:
    if isinstance(arg, fx.Node):
        value = arg.meta.get("example_value")
        text = _spec(value) or _mesh_text(value)
        return text if text is not None else arg.name
    if isinstance(arg, (list, tuple)):
        inner = ", ".join(_arg_text(a) for a in arg)
        return f"[{inner}]" if isinstance(arg, list) else f"({inner})"
    return repr(arg)


def _target_name(node: fx.Node) -> str:
    if node.op == "call_method":
        return f".{node.target}"
    if node.op == "call_module" or isinstance(node.target, torch._ops.OpOverload):
        return str(node.target)
    target = node.target
    module = getattr(target, "__module__", None)
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or str(target)
    if module in (None, "builtins", "_operator"):
        return name if module != "_operator" else f"operator.{name}"
    return f"{module}.{name}"


def describe_dynamo_graph(
    gm: fx.GraphModule, compile_id: str, axes: dict[str, str], profile: HardwareProfile, profile_why: str = "given"
) -> DynamoGraphInfo:
    """The placements of every DTensor node of a Dynamo graph (read from its example values)."""
    from torch.distributed.tensor import DTensor

    info = DynamoGraphInfo(compile_id, axes, profile, profile_why)
    meshes: dict[str, None] = {}  # reprs, in order of appearance
    uneven: list[str] = []
    for node in gm.graph.nodes:
        for value in pytree.tree_leaves(node.meta.get("example_value")):
            why = uneven_sharding(value) if isinstance(value, DTensor) else None
            if why is not None:
                uneven.append(f"{node.name} ({why})")
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        value = node.meta.get("example_value")
        inputs = [a.meta.get("example_value") for a in node.all_input_nodes]
        dtensors = [v for v in pytree.tree_leaves([value, inputs]) if isinstance(v, DTensor)]
        if not dtensors:
            continue
        for d in dtensors:
            meshes.setdefault(repr(real_object(d.device_mesh)))
        out = [s for s in (_spec(v) for v in pytree.tree_leaves(value)) if s is not None]
        output = out[0] if len(out) == 1 else (f"({', '.join(out)})" if out else "")
        args = tuple(_arg_text(a) for a in node.args) + tuple(f"{k}={_arg_text(v)}" for k, v in node.kwargs.items())
        info.nodes[node.name] = NodePlacement(node.name, _target_name(node), args, output, repr(real_object(dtensors[0].device_mesh)))
    info.meshes = tuple(meshes)
    info.node_names = frozenset(node.name for node in gm.graph.nodes)
    info.uneven = tuple(uneven)
    return info


def _source_node(node: fx.Node, info: DynamoGraphInfo, known: dict[fx.Node, str]) -> str | None:
    """The Dynamo node an AOT node was traced from: its ``from_node``; for a backward
    ``local_map`` region, its forward region's (paired by call id); for another
    backward node, the forward node with the same autograd sequence number; else
    (a wait, a gradient accumulation) the source of its first input that has one."""
    sources = node.meta.get("from_node") or []
    if sources:
        # The first entry is the outermost graph that produced it: the Dynamo graph.
        return sources[0].name
    call_id = region_call_id(node)
    if call_id is not None and call_id in info.region_calls:
        return info.region_calls[call_id]
    seq_nr = node.meta.get("seq_nr")
    if seq_nr is not None and seq_nr in info.seq_nr_to_node:
        return info.seq_nr_to_node[seq_nr]
    return next((known[a] for a in node.all_input_nodes if a in known), None)


def charge_collective(node: fx.Node, collective: CollectiveInfo, kind: GraphKind, info: DynamoGraphInfo, source: str | None) -> str:
    """Costs collective ``node`` under the profile, charges it to Dynamo node ``source``; returns its note."""
    link = info.profile.link(collective.group_span)
    time_us = collective_time_us(collective.op, collective.bytes, collective.group_size, link)
    node.meta[Meta.COLLECTIVE] = collective
    node.meta[Meta.COST_US] = time_us
    info.communication[source or "?"].append(Communication(kind, collective, time_us))
    return f"{collective.short} ~{time_us:.1f} us ({info.profile.name})"


def annotate_aot_graph(gm: fx.GraphModule, kind: GraphKind, info: DynamoGraphInfo) -> int:
    """Annotates every call node of an AOT graph (see the module docstring); returns how many."""
    count = 0
    known: dict[fx.Node, str] = {}
    if info.spmd_inputs:
        # The graph as the passes left it (new nodes: buckets); checked before them, where it was traced.
        type_graph(gm, kind, info.spmd_inputs, info.axes, info.spmd_forward, info.spmd_forward_outputs, check=False)
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        source = _source_node(node, info, known)
        if source is not None:
            known[node] = source
        if kind != GraphKind.BACKWARD and source is not None and node.meta.get("seq_nr") is not None:
            info.seq_nr_to_node.setdefault(node.meta["seq_nr"], source)
        if kind != GraphKind.BACKWARD and source is not None and region_call_id(node) is not None:
            info.region_calls[region_call_id(node)] = source
        node.meta[Meta.SOURCE] = source
        collective = collective_info(node, info.axes)
        if collective is not None:
            note = charge_collective(node, collective, kind, info, source)
        elif source is not None:
            placement = info.nodes.get(source)
            role = "grad of" if kind == GraphKind.BACKWARD and not node.meta.get("from_node") else "from"
            note = f"{role} {source}" + (f": {placement.output}" if placement is not None and placement.output else "")
        elif node.name in info.step_parts:
            note = info.step_parts[node.name]
        elif kind == GraphKind.STEP:
            note = "added by dtcompile's passes"
        else:
            note = "local: no DTensor op (AOTAutograd bookkeeping)"
        types = format_types(node.meta.get(Meta.SPMD_TYPE))
        if types:
            note += f"; {types}"
        bucket = node.meta.get(Meta.BUCKET)
        if bucket:
            note += f"; bucket of {len(bucket)}: {', '.join(bucket)}"
        node.meta[Meta.ANNOTATION] = note
        count += 1
    return count


def format_aot_graph(gm: fx.GraphModule) -> str:
    """The AOT graph, one line per call node, with its annotation."""
    lines = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        args = ", ".join(_short(a) for a in node.args)
        note = node.meta.get(Meta.ANNOTATION, "")
        lines.append(f"{node.name} = {_target_name(node)}({args})  # {note}")
    return "\n".join(lines)


def _short(arg: Any) -> str:
    if isinstance(arg, fx.Node):
        return arg.name
    if isinstance(arg, (list, tuple)):
        return "[" + ", ".join(_short(a) for a in arg) + "]"
    return repr(arg)
