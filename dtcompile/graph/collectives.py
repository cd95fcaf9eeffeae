"""What the functional collectives in an AOT graph are: kind, mesh axis, bytes.

After AOTAutograd, DTensor communication is a call to a ``_c10d_functional``
op followed by ``wait_tensor``.  :func:`collective_info` reads one such node;
the group is named by its process-group name, which we map back to the mesh
axis it was created for (DeviceMesh names its groups ``mesh_<axis>``).

Bytes per rank follow the nccl-tests convention: the size of the whole buffer
the collective moves, i.e. the output of an all-gather, the input of a
reduce-scatter, all-reduce or all-to-all.

A collective whose sizes depend on data (an ``all_to_all_single`` with split
sizes read from a tensor, as a MoE's token dispatch and combine are) is
``data_dependent``: its shape and bytes are estimates
(:data:`dtcompile.base.sizes.UNBACKED_HINT` per unknown size) and its text says
``data-dependent`` where the bytes would be.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

from dtcompile.base.op_facts import COLLECTIVE_OPS, CollectiveKind
from dtcompile.base.sizes import has_unbacked, nbytes_hint, shape_hint

__all__ = [
    "CollectiveInfo",
    "axis_name",
    "collective_info",
    "group_names_in",
    "graph_collectives",
    "spmd_axes",
    "collective_kind",
    "is_collective",
    "largest_collective",
    "mesh_axes",
]


@dataclass(frozen=True)
class CollectiveInfo:
    """One collective in a graph."""

    node: str
    """Name of the FX node that issues it."""
    op: CollectiveKind
    """``all_gather``, ``reduce_scatter``, ``all_reduce``, ``all_to_all`` or ``broadcast``."""
    axis: str
    """The mesh axis (dimension name) of its group, or the group's name."""
    group_size: int
    shape: tuple[int, ...]
    """Shape of the buffer counted in ``bytes`` (see the module docstring); a
    data-dependent size reads as its estimate."""
    dtype: torch.dtype
    bytes: int
    """Bytes per rank; an estimate when ``data_dependent``."""
    group_span: int = 1
    """How many consecutive ranks the group covers (``max - min + 1``): whether it
    fits in one node is what picks the link in the cost model."""
    fused: str = ""
    """``matmul`` when the collective is part of a fused collective-matmul op."""
    data_dependent: bool = False
    """Its sizes (split sizes, input or output shape) depend on the data: unbacked
    symbols, e.g. from ``.tolist()``.  ``shape``, ``bytes`` and the times costed from
    them are then estimates; passes that need its size leave it alone."""

    @property
    def label(self) -> str:
        """``all_gather``, or ``all_gather+matmul`` for a fused collective-matmul."""
        return f"{self.op}+{self.fused}" if self.fused else self.op

    @property
    def bytes_text(self) -> str:
        """``192 B``, or ``data-dependent`` (``bytes`` is then an estimate)."""
        return "data-dependent" if self.data_dependent else f"{self.bytes} B"

    @property
    def short(self) -> str:
        """``all_gather[tp] x4 192 B``: op, mesh axis, group size and bytes per rank."""
        return f"{self.label}[{self.axis}] x{self.group_size} {self.bytes_text}"

    def __str__(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        shape = "" if self.data_dependent else str(list(self.shape))
        return f"{self.label}[{self.axis}, group_size={self.group_size}] {dtype}{shape} {self.bytes_text}"


def _functional_op_name(node: fx.Node) -> tuple[str, str] | None:
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return None
    return target.namespace, target._opname


def _moved_values(node: fx.Node, name: tuple[str, str], count_output: bool) -> list[Any]:
    """The tensors whose bytes a collective moves (see the module docstring)."""
    if name == ("dtcompile", "fused_all_gather_matmul"):
        return [node.meta["val"][0]]  # the gathered operand
    if name == ("dtcompile", "fused_matmul_reduce_scatter"):
        a = node.args[0].meta["val"]
        return [torch.empty(node.args[2], dtype=a.dtype, device="meta")]  # the product reduce-scattered
    source = node if count_output else node.args[0]
    vals = source.meta.get("val")
    return list(vals) if isinstance(vals, (list, tuple)) else [vals]


def mesh_axes(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> dict[str, str]:
    """Group name -> mesh axis name, for every DeviceMesh that the graph's DTensors use,
    and for the groups of its plain-tensor collectives where ``spmd_types`` names them
    (:func:`spmd_axes`).

    Read from the Dynamo graph's inputs and node values before AOTAutograd
    desugars the DTensors away.  A 1-D mesh over the whole world reuses the
    default group, so only the mesh knows that group's axis name.  DTensor
    issues a collective over several axes on their flattened mesh where the user
    made one (``mesh["dp", "tp"]._flatten("dp_tp")``): its group is named after it.
    """
    from torch.distributed.tensor import DTensor

    values = list(example_inputs)
    values += [n.meta.get("example_value") for n in gm.graph.nodes]
    axes: dict[str, str] = {}
    for value in pytree.tree_leaves(values):
        if not isinstance(value, DTensor):
            continue
        mesh = value.device_mesh
        names = mesh.mesh_dim_names
        group_names = getattr(mesh, "_dim_group_names", None)
        if names is None or not group_names:
            continue
        axes.update(zip(group_names, names))
        for group_name, name in flattened_axes(mesh).items():
            axes.setdefault(group_name, name)
    for group_name, name in spmd_axes(group_names_in(gm)).items():
        axes.setdefault(group_name, name)
    return axes


def spmd_axes(group_names: Sequence[str]) -> dict[str, str]:
    """Group name -> mesh axis name, from ``spmd_types``' current mesh (torchtitan's
    ``set_current_spmd_mesh``), for the groups of plain-tensor collectives; empty where
    ``spmd_types`` is not imported or no mesh is current.  ``spmd_types`` knows an axis by
    its ranks' layout (``MeshAxis.of(group)``): the default group serves the ``tp`` axis
    of a world that is all tensor parallel."""
    spmd = sys.modules.get("spmd_types")
    names = spmd.current_mesh_names() if spmd is not None and group_names else None
    if not names:
        return {}
    from torch.distributed.distributed_c10d import _resolve_process_group

    by_axis = {axis: name for name, axis in names.items()}
    found = {}
    for group_name in group_names:
        axis = spmd.MeshAxis.of(_resolve_process_group(group_name))
        if axis in by_axis:
            found[group_name] = by_axis[axis]
    return found


def flattened_axes(mesh: Any) -> dict[str, str]:
    """Group name -> name, for every flattened mesh made from ``mesh``'s root mesh."""
    flattened = getattr(mesh._get_root_mesh(), "_flatten_mapping", {})
    return {flat._dim_group_names[0]: name for name, flat in flattened.items()}


def group_names_in(gm: fx.GraphModule) -> list[str]:
    """The process groups ``gm``'s functional collectives run on, by name, in program order
    (an AOT graph's nodes call the op overloads, a Dynamo graph's the op packets)."""
    names = []
    # A Dynamo graph keeps an autograd Function's body (spmd_types' collectives) as a subgraph.
    nodes = [node for module in gm.modules() if isinstance(module, fx.GraphModule) for node in module.graph.nodes]
    for node in nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            continue
        packet = target.overloadpacket if isinstance(target, torch._ops.OpOverload) else target
        namespace, _, name = packet._qualified_op_name.partition("::")
        if (namespace, name) in COLLECTIVE_OPS:
            names.append(node.args[COLLECTIVE_OPS[namespace, name][1]])
    return list(dict.fromkeys(names))


def collective_kind(node: fx.Node) -> tuple[CollectiveKind, Any] | None:
    """``(kind, group name)`` of a collective node (kind as :attr:`CollectiveInfo.op`: ``all_gather``,
    ``reduce_scatter``...; a fused collective-matmul counts as its collective), else None."""
    entry = COLLECTIVE_OPS.get(_functional_op_name(node))
    return (entry[0], node.args[entry[1]]) if entry is not None else None


def is_collective(node: fx.Node) -> bool:
    """Whether ``node`` issues a functional collective (its ``wait_tensor`` is not one)."""
    return _functional_op_name(node) in COLLECTIVE_OPS


def axis_name(group_name: str, axes: Mapping[str, str] | None = None) -> str:
    """The mesh axis a process group serves: from ``axes`` (see :func:`mesh_axes`),
    else from the group's description, else the group's name."""
    from torch.distributed import distributed_c10d as c10d

    if axes and group_name in axes:
        return axes[group_name]
    try:
        group = c10d._resolve_process_group(group_name)
    except (RuntimeError, ValueError, KeyError):
        return group_name
    desc = getattr(group, "group_desc", "") or ""
    if desc.startswith("mesh_"):
        return desc.removeprefix("mesh_")
    if c10d.is_initialized() and group is c10d._get_default_group():
        return "world"
    return group_name


def _group_size_and_span(group_name: str) -> tuple[int, int]:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    group = c10d._resolve_process_group(group_name)
    ranks = dist.get_process_group_ranks(group)
    return group.size(), max(ranks) - min(ranks) + 1


def collective_info(node: fx.Node, axes: Mapping[str, str] | None = None) -> CollectiveInfo | None:
    """Describes ``node`` if it issues a functional collective, else ``None``."""
    opname = _functional_op_name(node)
    if opname not in COLLECTIVE_OPS:
        return None
    kind, group_arg, count_output = COLLECTIVE_OPS[opname]
    group_name = node.args[group_arg]
    vals = _moved_values(node, opname, count_output)
    if not vals or any(not isinstance(v, torch.Tensor) for v in vals):
        raise AssertionError(f"collective {node.name} has no tensor metadata")
    shape = shape_hint(vals[0]) if len(vals) == 1 else (len(vals),)
    num_bytes = sum(nbytes_hint(v) for v in vals)
    group_size, group_span = _group_size_and_span(group_name)
    # An all-to-all's split sizes are arguments: unbacked ones make it data-dependent
    # even when its input's shape is known.
    sizes = [a.meta.get("val") for a in pytree.tree_leaves(node.args) if isinstance(a, fx.Node)]
    return CollectiveInfo(
        node=node.name,
        op=kind,
        axis=axis_name(group_name, axes),
        group_size=group_size,
        shape=shape,
        dtype=vals[0].dtype,
        bytes=num_bytes,
        group_span=group_span,
        fused="matmul" if opname[0] == "dtcompile" else "",
        data_dependent=has_unbacked(vals, node.meta.get("val"), sizes),
    )


def graph_collectives(
    graph: fx.Graph, axes: Mapping[str, str] | None = None
) -> list[CollectiveInfo]:
    """The collectives of ``graph`` in program order."""
    infos = (collective_info(n, axes) for n in graph.nodes)
    return [info for info in infos if info is not None]


def largest_collective(gm: fx.GraphModule) -> int:
    """The buffer of the graph's largest collective (bytes per rank, as
    :class:`CollectiveInfo` counts them), 0 without one."""
    infos = (collective_info(node) for node in gm.graph.nodes if is_collective(node))
    return max((info.bytes for info in infos if info is not None), default=0)
