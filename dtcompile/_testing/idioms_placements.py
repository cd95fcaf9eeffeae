"""The Placement family of the idiom corpus: placements constructed, inspected and compared.

Holds :data:`PLACEMENT_IDIOMS`: ``Shard`` (negative and strided dims too),
``Replicate`` and ``Partial`` (``sum``, ``max``, ``avg``) built into DTensors;
their predicates (``is_shard``, ``is_replicate``, ``is_partial``), fields,
``isinstance``, equality, hashing and iteration; and user subclasses
(:class:`RowShard`, :class:`ScaledPartial`) that must trace as themselves.
"""

from __future__ import annotations

from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from dtcompile._testing.idiom_spec import Idiom, _dt, _global, collector

__all__ = ["PLACEMENT_IDIOMS"]

PLACEMENT_IDIOMS: list[Idiom] = []
idiom = collector(PLACEMENT_IDIOMS)


@idiom("placements")
def construct_shard(mesh):
    return (lambda t: DTensor.from_local(t, mesh, [Shard(0)], run_check=False)), (_global(2, 4),)


@idiom("placements", world="local")
def construct_shard_negative_dim(mesh):
    return (lambda d: d.redistribute(mesh, [Shard(-1)])), (_dt(mesh, [Shard(0)], 8, 8),)


@idiom("placements")
def construct_replicate(mesh):
    return (lambda t: DTensor.from_local(t, mesh, [Replicate()], run_check=False) * 2), (_global(4, 4),)


@idiom("placements", world="local")
def construct_partial_sum(mesh):
    return (lambda t: DTensor.from_local(t, mesh, [Partial()], run_check=False).redistribute(mesh, [Replicate()])), (_global(4, 4),)


# On the fake PG an all_reduce leaves its input as it is: deterministic, so
# compiled and eager still agree value for value.  (LocalTensorMode cannot
# compile from_local with Partial("max"/"avg") or loss_parallel in stock torch.)
@idiom("placements")
def construct_partial_max(mesh):
    return (lambda t: DTensor.from_local(t, mesh, [Partial("max")], run_check=False).full_tensor()), (_global(4, 4),)


@idiom("placements")
def construct_partial_avg(mesh):
    return (lambda t: DTensor.from_local(t, mesh, [Partial("avg")], run_check=False).full_tensor()), (_global(4, 4),)


@idiom("placements", mesh="2d")
def construct_strided_shard(mesh):
    def fn(t):
        d = DTensor.from_local(t, mesh, [_StridedShard(0, split_factor=4), Shard(0)], run_check=False)
        return d.to_local() * len(d.placements)

    return fn, (_global(2, 4),)


@idiom("placements")
def placement_is_shard_dim(mesh):
    return (lambda d: d.to_local() * 2 if d.placements[0].is_shard(0) and not d.placements[0].is_shard(1) else d.to_local()), (
        _dt(mesh, [Shard(0)], 8, 4),
    )


@idiom("placements")
def placement_is_replicate(mesh):
    return (lambda d: d.to_local() + 1 if d.placements[0].is_replicate() else d.to_local()), (_dt(mesh, [Replicate()], 4, 4),)


@idiom("placements")
def placement_is_partial(mesh):
    return (lambda d: d.to_local() + 1 if d.placements[0].is_partial() else d.to_local()), (
        DTensor.from_local(_global(4, 4), mesh, [Partial()], run_check=False),
    )


@idiom("placements")
def placement_dim(mesh):
    return (lambda d: d.to_local().sum(d.placements[0].dim)), (_dt(mesh, [Shard(1)], 4, 8),)


@idiom("placements")
def placement_reduce_op(mesh):
    return (lambda d: d.to_local() * (2 if d.placements[0].reduce_op == "max" else 3)), (
        DTensor.from_local(_global(4, 4), mesh, [Partial("max")], run_check=False),
    )


@idiom("placements")
def placement_isinstance(mesh):
    def fn(d):
        p = d.placements[0]
        return d.to_local() * (2 if isinstance(p, Shard) and not isinstance(p, (Replicate, Partial)) else 3)

    return fn, (_dt(mesh, [Shard(0)], 8, 4),)


@idiom("placements", mesh="2d")
def placements_equal_tuple(mesh):
    return (lambda d: d.to_local() * 2 if d.placements == (Replicate(), Shard(0)) else d.to_local()), (
        _dt(mesh, [Replicate(), Shard(0)], 8, 4),
    )


@idiom("placements")
def placement_hash(mesh):
    return (lambda d: d.to_local() * {Shard(0): 2.0, Replicate(): 3.0}[d.placements[0]]), (_dt(mesh, [Shard(0)], 8, 4),)


@idiom("placements", mesh="2d")
def placements_iterate_and_branch(mesh):
    def fn(d):
        out = d.to_local()
        for axis, p in enumerate(d.placements):
            if p.is_shard():
                out = out * (axis + 2)
            elif p.is_replicate():
                out = out + axis
        return out

    return fn, (_dt(mesh, [Replicate(), Shard(1)], 4, 8),)


class RowShard(Shard):
    """A user subclass of ``Shard`` (e.g. to tag a layout); must trace as itself."""

    def __repr__(self) -> str:
        return f"RowShard({self.dim})"


class ScaledPartial(Partial):
    """A user ``Partial`` whose reduction scales the sum; must never trace as ``Partial('sum')``."""

    def __init__(self, scale: float = 0.5) -> None:
        super().__init__("sum")
        self.scale = scale

    def _reduce_value(self, tensor, mesh, mesh_dim):
        return super()._reduce_value(tensor, mesh, mesh_dim) * self.scale

    def __eq__(self, other: object) -> bool:
        return type(other) is ScaledPartial and other.scale == self.scale

    def __hash__(self) -> int:
        return hash((ScaledPartial, self.scale))

    def __repr__(self) -> str:
        return f"ScaledPartial({self.scale})"


@idiom("placements")
def placement_user_shard_subclass(mesh):
    def fn(t):
        d = DTensor.from_local(t, mesh, [RowShard(0)], run_check=False)
        return d.to_local() * (2 if type(d.placements[0]) is RowShard else 3)

    return fn, (_global(2, 4),)


@idiom("placements", world="local")
def placement_user_partial_subclass(mesh):
    def fn(t):
        return DTensor.from_local(t, mesh, [ScaledPartial(0.25)], run_check=False).redistribute(mesh, [Replicate()]).to_local()

    return fn, (_global(4, 4),)
