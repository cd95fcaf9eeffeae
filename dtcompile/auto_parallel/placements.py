"""Placements as the solver sees them: enumeration, text, local sizes, and one collective.

A *layout* is a tuple of placements, one per mesh axis (``(Shard(0), Replicate())``),
written ``S(0)R`` (:func:`text`, the notation of :mod:`dtcompile.hops.spec`).  The solver
offers a parameter or an input every layout that shards its dims evenly
(:func:`layouts`): an uneven shard makes DTensor pad, and dtcompile's
communication passes leave such graphs alone, so the solver does not choose them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from dtcompile.cost import HardwareProfile, collective_time_us
from dtcompile.hops.spec import format_placements

__all__ = [
    "Layout",
    "PlannedCollective",
    "axis_span",
    "even",
    "grad_layout",
    "is_partial",
    "is_shard",
    "is_strided",
    "layouts",
    "local_numel",
    "output_grad_layout",
    "strided_variant",
    "text",
    "unstrided",
]

Layout = tuple[Any, ...]
"""One placement per mesh axis."""


@dataclass(frozen=True)
class PlannedCollective:
    """One collective a choice implies: what it is, on which mesh axis, and its bytes per rank.

    ``bytes`` follows :mod:`dtcompile.graph.collectives` (the gathered output of an
    all-gather, the input of the others), so it compares with the compiled graphs'.
    """

    direction: str
    """``forward`` or ``backward``."""
    op: str
    axis: str
    group_size: int
    bytes: int
    group_span: int = 1

    def time_us(self, profile: HardwareProfile) -> float:
        return collective_time_us(self.op, self.bytes, self.group_size, profile.link(self.group_span))

    def key(self) -> tuple[str, str, str, int]:
        """``(direction, op, axis, bytes)``: what the compiled graphs are compared on."""
        return (self.direction, self.op, self.axis, self.bytes)

    def __str__(self) -> str:
        return f"{self.direction} {self.op}[{self.axis}] x{self.group_size} {self.bytes} B"


def text(layout: Layout | None) -> str:
    """``S(0)R``; ``-`` for no tensor."""
    return "-" if layout is None else format_placements(layout)


# The answer for placements of these exact types, read before ``isinstance``: torch 2.15's
# placements are C++ classes whose metaclass answers a failing ``isinstance`` in Python
# (ten times a plain one), and the planner asks millions of times.
_SHARDS = {Shard: True, _StridedShard: True, Replicate: False, Partial: False}


def is_shard(placement: Any) -> bool:
    """``Shard`` or ``_StridedShard`` (which is no ``Shard`` subclass in torch 2.13 to 2.15)."""
    known = _SHARDS.get(type(placement))
    return isinstance(placement, (Shard, _StridedShard)) if known is None else known


def is_partial(placement: Any) -> bool:
    """``Partial`` or a subclass of it (an embedding's ``_MaskPartial``)."""
    kind = type(placement)
    return kind is Partial or (kind not in _SHARDS and isinstance(placement, Partial))


def is_strided(placement: Any) -> bool:
    """``_StridedShard``."""
    kind = type(placement)
    return kind is _StridedShard or (kind not in _SHARDS and isinstance(placement, _StridedShard))


def even(shape: Sequence[int], layout: Layout, mesh_shape: Sequence[int]) -> bool:
    """Whether every sharded dim of ``shape`` divides evenly by the axes that shard it."""
    ways = [1] * len(shape)
    for placement, size in zip(layout, mesh_shape):
        if is_shard(placement):
            if placement.dim >= len(shape):
                return False
            ways[placement.dim] *= size
    return all(s % w == 0 for s, w in zip(shape, ways))


def local_numel(shape: Sequence[int], layout: Layout, mesh_shape: Sequence[int]) -> int:
    """Elements of one rank's shard of an evenly sharded tensor."""
    numel = math.prod(shape)
    for placement, size in zip(layout, mesh_shape):
        if is_shard(placement):
            numel //= size
    return numel


def layouts(shape: Sequence[int], mesh_shape: Sequence[int], *, strided: bool = False) -> list[Layout]:
    """Every layout of a tensor of ``shape`` without ``Partial``, sharding evenly; replicated first.

    With ``strided``, each layout in which an axis shards a dim that a later axis shards
    too is also offered as :func:`strided_variant` (FSDP2 over tensor parallelism)."""
    per_axis = [Replicate()] + [Shard(d) for d in range(len(shape))]
    found: list[Layout] = [()]
    for _ in mesh_shape:
        found = [(*prefix, p) for prefix in found for p in per_axis]
    found = [layout for layout in found if even(shape, layout, mesh_shape)]
    if strided:
        found += [v for v in map(functools.partial(strided_variant, mesh_shape=mesh_shape), found) if v is not None]
    found.sort(key=lambda layout: sum(map(is_shard, layout)))
    return found


def strided_variant(layout: Layout, mesh_shape: Sequence[int]) -> Layout | None:
    """``layout`` with the axis that shards a dim a later axis shards too made a
    ``_StridedShard`` (``None`` where there is no such axis, or more than one):
    ``(S(0), S(0))`` becomes ``(_S(0,4), S(0))`` on a 2 x 4 mesh.

    DTensor's ``(S(0), S(0))`` gives rank ``(d, t)`` row block ``4d + t``: the later
    axis splits each of the earlier axis's shards.  ``_StridedShard(0, split_factor=4)``
    on the earlier axis turns that around: the later axis (tensor parallelism) splits
    the tensor first, the earlier one (data parallelism) each of those shards, as
    FSDP2's ``fully_shard`` lays out a tensor-parallel parameter.  Gathered over the
    earlier axis it is the later axis's ``Shard`` -- one all-gather, where ``(S(0), S(0))``
    must be gathered whole and cut again -- and a gradient ``Partial`` over the earlier
    axis reduce-scatters straight into it."""
    strided = []
    for axis, placement in enumerate(layout):
        if not isinstance(placement, Shard):
            continue
        split = math.prod(
            size for later, size in zip(layout[axis + 1:], mesh_shape[axis + 1:]) if later == Shard(placement.dim)
        )
        if split > 1:
            strided.append((axis, _StridedShard(placement.dim, split_factor=split)))
    # FSDP2's one strided axis only: several (a dim sharded over three axes) are left out.
    if len(strided) != 1:
        return None
    (axis, placement), = strided
    return (*layout[:axis], placement, *layout[axis + 1:])


def unstrided(layout: Layout) -> Layout:
    """``layout`` gathered over its ``_StridedShard`` axes: where ops read a value stored so."""
    return tuple(Replicate() if is_strided(p) else p for p in layout)


def grad_layout(grad: Layout, value: Layout) -> Layout:
    """Where the gradient of a value of layout ``value`` lands after ``redistribute``'s
    backward, the gradient arriving as ``grad``: DTensor keeps a replicated or sharded
    gradient replicated where the value was ``Partial`` (``_redistribute_backward``)."""
    return tuple(
        Replicate() if isinstance(v, Partial) and not isinstance(g, Partial) else v for g, v in zip(grad, value)
    )


def output_grad_layout(value: Layout) -> Layout:
    """The layout in which a value's gradient reaches the op that made it, in the applied model:
    every consumer reads the value through a ``redistribute`` whose backward lands the gradient
    in :func:`grad_layout`, replicated where the value is ``Partial`` (edges where a gradient
    would stay ``Partial`` there are not offered)."""
    return tuple(Replicate() if isinstance(p, Partial) else p for p in value)


@functools.lru_cache(maxsize=256)
def axis_span(mesh: Any, axis: int) -> int:
    """How many consecutive ranks one group of ``axis`` spans (``max - min + 1``)."""
    ranks = mesh.mesh.movedim(axis, -1).reshape(-1, mesh.mesh.shape[axis])[0]
    return int(ranks.max() - ranks.min() + 1)
