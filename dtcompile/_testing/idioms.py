"""A corpus of DTensor idioms that real training code writes inside compiled regions.

Each :class:`Idiom` builds, for a mesh, a function and its inputs.  The checker
(:func:`check_idiom`) compiles the function with ``fullgraph=True`` and checks,
against eager:

- values (outputs and input gradients), on the fake process group when the
  idiom does not read a collective's result, else on ``LocalTensorMode``
  (every rank simulated, real collective semantics) -- ``world="local"``;
- placements, and that every DTensor result carries the very mesh object the
  user built;
- no graph break, and no recompile on a second call with the same inputs.

Idioms that draw random numbers compare shapes, placements and dtypes only
(``values=False``): compiled RNG is not eager RNG.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.tensor as dtensor
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_tensor,
)
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils import _pytree as pytree

from dtcompile.testing.asserts import per_rank, run_step
from dtcompile.testing.worlds import fake_world, simulated_world

__all__ = ["IDIOMS", "MESHES", "Idiom", "IdiomResult", "check_idiom", "corpus_failures", "mesh_world"]

# Mesh kinds: name -> (world size, shape, dim names).
MESHES: dict[str, tuple[int, tuple[int, ...], tuple[str, ...]]] = {
    "1d": (4, (4,), ("tp",)),
    "2d": (8, (2, 4), ("dp", "tp")),
    "3d": (8, (2, 2, 2), ("dp", "cp", "tp")),
}


@dataclass(frozen=True)
class Idiom:
    name: str
    family: str
    """``device_mesh``, ``placements``, ``process_group`` or ``dtensor_api``."""
    build: Callable[[DeviceMesh], tuple[Any, ...]]
    """mesh -> ``(fn, args)`` or ``(fn, args, eager_reference)`` when eager ``fn`` cannot run here."""
    mesh: str = "1d"
    world: str = "fake"
    """``fake``: values on the fake PG; ``local``: values on LocalTensorMode."""
    backward: bool = False
    values: bool = True
    context: Callable[[], Any] | None = None
    """A context manager factory around each run (eager and compiled), backward included."""


IDIOMS: list[Idiom] = []


def idiom(family: str, mesh: str = "1d", **kwargs: Any) -> Callable[[Callable], Callable]:
    def register(build: Callable) -> Callable:
        IDIOMS.append(Idiom(build.__name__, family, build, mesh=mesh, **kwargs))
        return build

    return register


def _global(*shape: int, seed: int = 0, requires_grad: bool = False) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).requires_grad_(requires_grad)


def _dt(mesh: DeviceMesh, placements: list[Placement], *shape: int, requires_grad: bool = False, seed: int = 0) -> DTensor:
    """A DTensor of a seeded global tensor, each rank keeping its own shard (no communication)."""
    out = distribute_tensor(_global(*shape, seed=seed), mesh, placements, src_data_rank=None)
    return out.requires_grad_(requires_grad)


# ---------------------------------------------------------------- device mesh


@idiom("device_mesh")
def mesh_ndim(mesh):
    return (lambda t: t * mesh.ndim), (_global(4, 4),)


@idiom("device_mesh")
def mesh_device_type(mesh):
    return (lambda t: t * 2 if mesh.device_type == "cpu" else t), (_global(4, 4),)


@idiom("device_mesh", mesh="2d")
def mesh_dim_names(mesh):
    return (lambda t: t * len(mesh.mesh_dim_names) if "tp" in mesh.mesh_dim_names else t), (_global(4, 4),)


@idiom("device_mesh", mesh="2d")
def mesh_shape(mesh):
    return (lambda t: t * mesh.shape[0] + mesh.shape[1]), (_global(4, 4),)


@idiom("device_mesh", mesh="2d")
def mesh_size(mesh):
    return (lambda t: t * mesh.size()), (_global(4, 4),)


@idiom("device_mesh", mesh="2d")
def mesh_size_of_axis(mesh):
    return (lambda t: t * mesh.size(1) + mesh.size(0)), (_global(4, 4),)


@idiom("device_mesh", mesh="2d")
def mesh_get_coordinate(mesh):
    return (lambda t: t + mesh.get_coordinate()[1] + 10 * mesh.get_coordinate()[0]), (_global(4, 4),)


@idiom("device_mesh")
def mesh_get_rank(mesh):
    return (lambda t: t + mesh.get_rank()), (_global(4, 4),)


@idiom("device_mesh", mesh="2d")
def mesh_get_local_rank(mesh):
    return (lambda t: t + mesh.get_local_rank("tp") * 3 + mesh.get_local_rank(0)), (_global(4, 4),)


@idiom("device_mesh", mesh="2d")
def mesh_get_group(mesh):
    return (lambda t: t * mesh.get_group("tp").size() + mesh.get_group("dp").rank()), (_global(4, 4),)


@idiom("device_mesh", mesh="2d")
def mesh_get_all_groups(mesh):
    return (lambda t: t * sum(g.size() for g in mesh.get_all_groups())), (_global(4, 4),)


@idiom("device_mesh", mesh="2d")
def mesh_slice_one_name(mesh):
    return (lambda t: t * mesh["tp"].size() + mesh["tp"].get_local_rank()), (_global(4, 4),)


@idiom("device_mesh", mesh="3d")
def mesh_slice_several_names(mesh):
    def fn(t):
        sub = mesh["dp", "cp"]
        return t * sub.size() + sub.ndim

    return fn, (_global(4, 4),)


@idiom("device_mesh", mesh="2d")
def mesh_flatten(mesh):
    return (lambda t: t * mesh["dp", "tp"]._flatten().size()), (_global(4, 4),)


@idiom("device_mesh", mesh="2d")
def mesh_flatten_for_dtensor(mesh):
    def fn(t):
        flat = mesh["dp", "tp"]._flatten("dp_tp")
        return DTensor.from_local(t, flat, [Shard(0)], run_check=False).to_local() * flat.size()

    return fn, (_global(2, 4),)


@idiom("device_mesh", mesh="2d")
def mesh_equality(mesh):
    tp = mesh["tp"]
    return (lambda t: t * 2 if mesh["tp"] == tp and mesh != tp else t), (_global(4, 4),)


@idiom("device_mesh")
def mesh_hash(mesh):
    return (lambda t: t * 2 if hash(mesh) == hash(mesh) else t), (_global(4, 4),)


@idiom("device_mesh", mesh="2d")
def mesh_as_dict_key(mesh):
    def fn(t):
        scale = {mesh["dp"]: 2.0, mesh["tp"]: 3.0}
        return t * scale[mesh["tp"]]

    return fn, (_global(4, 4),)


def _scale_by_axis(mesh: DeviceMesh, t: torch.Tensor, axis: str) -> torch.Tensor:
    return t * mesh.size(mesh.mesh_dim_names.index(axis))


@idiom("device_mesh", mesh="2d")
def mesh_passed_to_helper(mesh):
    return (lambda t, m: _scale_by_axis(m, t, "tp")), (_global(4, 4), mesh)


class _MeshHolder(nn.Module):
    def __init__(self, mesh: DeviceMesh) -> None:
        super().__init__()
        self.mesh = mesh
        self.weight = nn.Parameter(_global(4, 4, seed=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = DTensor.from_local(self.weight, self.mesh, [Replicate()], run_check=False)
        return (w * x).to_local()


@idiom("device_mesh", backward=True)
def mesh_module_attribute(mesh):
    return _MeshHolder(mesh), (_dt(mesh, [Replicate()], 4, 4),)


@idiom("device_mesh", mesh="2d")
def mesh_of_dtensor(mesh):
    def fn(d):
        m = d.device_mesh
        return d.to_local() * m.size(1) if m is mesh and m.mesh_dim_names == ("dp", "tp") else d.to_local()

    return fn, (_dt(mesh, [Shard(0), Shard(1)], 8, 8),)


@idiom("device_mesh", mesh="3d")
def mesh_submesh_coordinate(mesh):
    return (lambda t: t + mesh["cp"].get_local_rank() + mesh["dp", "tp"].get_coordinate()[1]), (_global(4, 4),)


# ---------------------------------------------------------------- placements


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


# ---------------------------------------------------------------- process groups


@idiom("process_group", mesh="2d")
def pg_rank_and_size(mesh):
    pg = mesh.get_group("tp")
    return (lambda t: t * pg.size() + pg.rank()), (_global(4, 4),)


@idiom("process_group", mesh="2d")
def pg_group_name(mesh):
    pg = mesh.get_group("tp")
    name = pg.group_name
    return (lambda t: t * 2 if pg.group_name == name else t), (_global(4, 4),)


@idiom("process_group", mesh="2d")
def pg_dist_get_rank(mesh):
    pg = mesh.get_group("tp")
    return (lambda t: t + dist.get_rank(pg) + dist.get_rank()), (_global(4, 4),)


@idiom("process_group", mesh="2d")
def pg_dist_get_world_size(mesh):
    pg = mesh.get_group("tp")
    return (lambda t: t * dist.get_world_size(group=pg) + dist.get_world_size()), (_global(4, 4),)


@idiom("process_group", mesh="2d")
def pg_get_process_group_ranks(mesh):
    pg = mesh.get_group("dp")
    return (lambda t: t + sum(dist.get_process_group_ranks(pg))), (_global(4, 4),)


@idiom("process_group")
def pg_group_world(mesh):
    return (lambda t: t * dist.get_world_size(dist.group.WORLD) + dist.get_rank(dist.group.WORLD)), (_global(4, 4),)


@idiom("process_group", mesh="2d", world="local")
def funcol_all_reduce_group(mesh):
    pg = mesh.get_group("tp")
    return (lambda t: funcol.all_reduce(t, "sum", pg)), (_global(4, 4),)


@idiom("process_group", world="local")
def funcol_all_reduce_mesh(mesh):
    return (lambda t: funcol.all_reduce(t * 2, "sum", mesh)), (_global(4, 4),)


@idiom("process_group", mesh="2d", world="local")
def funcol_all_gather_mesh_axis(mesh):
    return (lambda t: funcol.all_gather_tensor(t, 0, (mesh, 1))), (_global(2, 4),)


@idiom("process_group", mesh="2d", world="local")
def funcol_reduce_scatter_group(mesh):
    pg = mesh.get_group("tp")
    return (lambda t: funcol.reduce_scatter_tensor(t, "sum", 0, pg)), (_global(8, 4),)


@idiom("process_group", mesh="2d", world="local", backward=True)
def funcol_all_gather_autograd(mesh):
    return (lambda t: funcol.all_gather_tensor_autograd(t * 2, 0, (mesh, 1)).sum(0)), (
        _global(2, 4, requires_grad=True),
    )


# ---------------------------------------------------------------- DTensor API


@idiom("dtensor_api", backward=True)
def from_local_without_shape(mesh):
    return (lambda t: DTensor.from_local(t * 2, mesh, [Shard(0)], run_check=False)), (_global(2, 4, requires_grad=True),)


@idiom("dtensor_api", backward=True)
def from_local_with_shape_and_stride(mesh):
    def fn(t):
        return DTensor.from_local(t, mesh, [Shard(0)], run_check=False, shape=torch.Size([7, 4]), stride=(4, 1))

    return fn, (_global(2, 4, requires_grad=True),)


@idiom("dtensor_api", backward=True)
def to_local_with_grad_placements(mesh):
    return (lambda d: d.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()]) * 3), (
        _dt(mesh, [Replicate()], 4, 4, requires_grad=True),
    )


@idiom("dtensor_api", world="local", backward=True)
def redistribute_shard_to_replicate(mesh):
    return (lambda d: d.redistribute(mesh, [Replicate()])), (_dt(mesh, [Shard(0)], 8, 4, requires_grad=True),)


@idiom("dtensor_api", backward=True)
def redistribute_replicate_to_shard(mesh):
    return (lambda d: d.redistribute(mesh, [Shard(1)])), (_dt(mesh, [Replicate()], 4, 8, requires_grad=True),)


@idiom("dtensor_api", world="local")
def redistribute_partial_to_replicate(mesh):
    return (lambda t: DTensor.from_local(t, mesh, [Partial()], run_check=False).redistribute(mesh, [Replicate()])), (_global(4, 4),)


@idiom("dtensor_api", world="local")
def redistribute_partial_to_shard(mesh):
    return (lambda t: DTensor.from_local(t, mesh, [Partial()], run_check=False).redistribute(mesh, [Shard(0)])), (_global(8, 4),)


@idiom("dtensor_api", world="local", backward=True)
def redistribute_shard_to_shard(mesh):
    return (lambda d: d.redistribute(mesh, [Shard(1)])), (_dt(mesh, [Shard(0)], 8, 8, requires_grad=True),)


@idiom("dtensor_api", mesh="2d", world="local", backward=True)
def redistribute_2d_to_replicate(mesh):
    return (lambda d: d.redistribute(mesh, [Replicate(), Replicate()])), (
        _dt(mesh, [Shard(0), Shard(1)], 8, 8, requires_grad=True),
    )


@idiom("dtensor_api", mesh="2d", world="local")
def redistribute_2d_partial(mesh):
    def fn(t):
        return DTensor.from_local(t, mesh, [Partial(), Replicate()], run_check=False).redistribute(mesh, [Replicate(), Shard(0)])

    return fn, (_global(8, 4),)


@idiom("dtensor_api", world="local", backward=True)
def full_tensor(mesh):
    return (lambda d: d.full_tensor() * 2), (_dt(mesh, [Shard(0)], 8, 4, requires_grad=True),)


@idiom("dtensor_api", mesh="2d")
def dtensor_attribute_reads(mesh):
    def fn(d):
        assert d.shape == (8, 8)
        scale = d.size(0) + d.ndim + d.stride(0) + len(d.placements) + d.device_mesh.ndim
        return d.to_local() * scale if d.dtype == torch.float32 and d.to_local().shape == (4, 2) else d.to_local()

    return fn, (_dt(mesh, [Shard(0), Shard(1)], 8, 8),)


@idiom("dtensor_api", world="local")
def distribute_tensor_shard(mesh):
    return (lambda t: distribute_tensor(t * 2, mesh, [Shard(0)])), (_global(8, 4),)


@idiom("dtensor_api", mesh="2d", world="local")
def distribute_tensor_2d(mesh):
    return (lambda t: distribute_tensor(t, mesh, [Replicate(), Shard(1)])), (_global(4, 8),)


@idiom("dtensor_api")
def factory_ones(mesh):
    return (lambda t: dtensor.ones(8, 4, device_mesh=mesh, placements=[Shard(0)]) + t), (_dt(mesh, [Shard(0)], 8, 4),)


@idiom("dtensor_api", mesh="2d")
def factory_zeros(mesh):
    return (lambda t: dtensor.zeros((8, 4), device_mesh=mesh, placements=[Replicate(), Shard(1)]) + t), (
        _dt(mesh, [Replicate(), Shard(1)], 8, 4),
    )


@idiom("dtensor_api")
def factory_full(mesh):
    return (lambda t: dtensor.full((8, 4), 1.5, device_mesh=mesh, placements=[Replicate()]) * t), (_dt(mesh, [Replicate()], 8, 4),)


@idiom("dtensor_api", values=False)
def factory_empty(mesh):
    return (lambda t: dtensor.empty(8, 4, device_mesh=mesh, placements=[Shard(1)]).to_local().shape == t.shape), (_global(8, 1),)


@idiom("dtensor_api")
def factory_default_placements(mesh):
    return (lambda: dtensor.zeros(4, 4, device_mesh=mesh)), ()


@idiom("dtensor_api", mesh="2d")
def local_shape_and_offset(mesh):
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    def fn(t):
        shape, offset = compute_local_shape_and_global_offset((8, 8), mesh, [Shard(0), Shard(1)])
        return t[: shape[0], : shape[1]] + offset[0] * 100 + offset[1]

    return fn, (_global(8, 8),)


@idiom("dtensor_api", mesh="2d")
def local_shape_and_offset_strided(mesh):
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    def fn(t):
        placements = [_StridedShard(0, split_factor=4), Shard(0)]
        shape, offset = compute_local_shape_and_global_offset((16, 4), mesh, placements)
        return t[: shape[0]] * (offset[0] + 1)

    return fn, (_global(16, 4),)


@idiom("dtensor_api")
def implicit_replication_context(mesh):
    from torch.distributed.tensor.experimental import implicit_replication

    def fn(d, bias):
        with implicit_replication():
            out = d + bias
        return out * 2

    return fn, (_dt(mesh, [Shard(0)], 8, 4), _global(4, seed=3))


def _loss_parallel() -> Any:
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


@idiom("dtensor_api")
def loss_parallel_inside(mesh):
    from torch.distributed.tensor.parallel import loss_parallel

    def fn(logits, target):
        with loss_parallel():
            loss = nn.functional.cross_entropy(logits, target)
        return loss * 2

    return fn, (_dt(mesh, [Shard(1)], 4, 16), torch.tensor([1, 5, 9, 14]))


# As torchtitan writes it: the caller's loss_parallel() spans the compiled loss and backward.
@idiom("dtensor_api", backward=True, context=_loss_parallel)
def loss_parallel_around(mesh):
    def fn(logits, target):
        return nn.functional.cross_entropy(logits, target)

    return fn, (_dt(mesh, [Shard(1)], 4, 16, requires_grad=True), torch.tensor([1, 5, 9, 14]))


@idiom("dtensor_api", backward=True)
def backward_through_from_local(mesh):
    def fn(t, w):
        d = DTensor.from_local(t, mesh, [Shard(0)], run_check=False)
        return (d * w).to_local()

    return fn, (_global(2, 4, requires_grad=True), _dt(mesh, [Replicate()], 4, requires_grad=True))


@idiom("dtensor_api", mesh="2d", world="local", backward=True)
def matmul_colwise_rowwise(mesh):
    def fn(x, w1, w2):
        h = (x @ w1).relu()
        return (h @ w2).redistribute(mesh, [Replicate(), Replicate()])

    return fn, (
        _dt(mesh, [Shard(0), Replicate()], 4, 8, requires_grad=True),
        _dt(mesh, [Replicate(), Shard(1)], 8, 16, requires_grad=True, seed=1),
        _dt(mesh, [Replicate(), Shard(0)], 16, 8, requires_grad=True, seed=2),
    )


# ---------------------------------------------------------------- the checker


@contextlib.contextmanager
def mesh_world(kind: str, world: str = "fake") -> Iterator[DeviceMesh]:
    """A fake world for mesh kind ``kind`` and its mesh; with ``world="local"`` a simulated one."""
    world_size, shape, names = MESHES[kind]
    enter = simulated_world if world == "local" else fake_world
    with enter(world_size, shape, names) as mesh:
        yield mesh


@dataclass
class IdiomResult:
    """What happened to one idiom under one compiler."""

    name: str
    ok: bool
    error: str = ""
    num_frames: int = 0
    num_graph_breaks: int = 0
    notes: list[str] = field(default_factory=list)


def _plain(x: Any) -> Any:
    """A comparable value: every rank's tensor, stacked (one rank outside LocalTensorMode)."""
    from torch.distributed._local_tensor import local_tensor_mode

    mode = local_tensor_mode()
    return torch.stack(per_rank(x, len(mode.ranks) if mode is not None else 1)) if isinstance(x, torch.Tensor) else x


def _summary(x: Any, mesh: DeviceMesh, values: bool, what: str) -> Any:
    """What is compared for one output leaf; raises if a DTensor carries another mesh."""
    if isinstance(x, DTensor):
        # Eager DTensor may hand back an earlier mesh equal to this one (its
        # sharding cache compares meshes by ==): identity is checked on compiled results.
        if what.startswith("eager"):
            if x.device_mesh != mesh and x.device_mesh._get_root_mesh() != mesh:
                raise AssertionError(f"{what}: a DTensor on mesh {x.device_mesh!r}, not on {mesh!r}")
        elif x.device_mesh is not mesh and x.device_mesh._get_root_mesh() is not mesh:
            raise AssertionError(
                f"{what}: a DTensor carries mesh {x.device_mesh!r} ({type(x.device_mesh).__name__} "
                f"at {id(x.device_mesh):#x}), not the user's mesh (at {id(mesh):#x})"
            )
        local = x.to_local()
        return ("DTensor", tuple(x.placements), tuple(x.shape), x.dtype, _plain(local) if values else tuple(local.shape))
    if isinstance(x, torch.Tensor):
        return ("Tensor", x.dtype, _plain(x) if values else tuple(x.shape))
    return x


def _run(fn: Callable, args: tuple, backward: bool, context: Callable[[], Any] | None, params: Any = None) -> tuple[Any, Any]:
    with context() if context is not None else contextlib.nullcontext():
        step = run_step(fn, args, backward, params=params)
    return step.outputs, step.grads


def _assert_same(expected: Any, actual: Any, what: str) -> None:
    exp_leaves, exp_spec = pytree.tree_flatten(expected)
    act_leaves, act_spec = pytree.tree_flatten(actual)
    if exp_spec != act_spec:
        raise AssertionError(f"{what}: structure {act_spec} != eager {exp_spec}")
    for e, a in zip(exp_leaves, act_leaves):
        if isinstance(e, torch.Tensor):
            torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")
        elif e != a:
            raise AssertionError(f"{what}: {a!r} != eager {e!r}")


def check_idiom(item: Idiom, backend: Any) -> IdiomResult:
    """Compile ``item`` with ``backend`` (``fullgraph=True``) and compare with eager; never raises."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    counter = CompileCounterWithBackend(backend)
    result = IdiomResult(item.name, ok=False)
    try:
        with mesh_world(item.mesh, item.world) as mesh:
            fn, args, *reference = item.build(mesh)
            eager_out, eager_grads = _run(reference[0] if reference else fn, args, item.backward, item.context)
            compiled = torch.compile(fn, backend=counter, fullgraph=True)
            params = fn if isinstance(fn, nn.Module) else None
            out, grads = _run(compiled, args, item.backward, item.context, params)
            again, _ = _run(compiled, args, False, item.context, params)

            def summarize(x: Any, what: str) -> Any:
                return pytree.tree_map(lambda leaf: _summary(leaf, mesh, item.values, what), x)

            expected_out = summarize(eager_out, "eager output")
            expected_grads = summarize(eager_grads, "eager gradients")
            _assert_same(expected_out, summarize(out, "compiled output"), "compiled output")
            _assert_same(expected_out, summarize(again, "second call's output"), "second call's output")
            _assert_same(expected_grads, summarize(grads, "compiled gradients"), "compiled gradients")
        result.num_frames = counter.frame_count
        result.num_graph_breaks = sum(counters["graph_break"].values())
        if result.num_frames != 1:
            raise AssertionError(f"compiled {result.num_frames} frames (a recompile or a graph break); expected 1")
        result.ok = True
    except Exception as err:  # noqa: BLE001 - the corpus reports every failure
        first = (str(err).strip().splitlines() or [""])[0]
        result.error = f"{type(err).__name__}: {first}"[:300]
    finally:
        torch._dynamo.reset()
    return result


def corpus_failures(backend: Any, *, stock: bool = False) -> dict[str, str]:
    """Every idiom checked with ``backend``: the failed ones' names and errors.

    ``stock=True`` runs torch as users run it without dtcompile: dynamo_vars
    uninstalled, and DTensor's sharding caches left as they are between programs
    (dtcompile's worlds and backend empty them, so a fake mesh cached by one
    program would otherwise never reach the next).  Run it in a fresh process:
    which stock runs see a fake mesh depends on what ran before.
    """
    import dtcompile.base.sharding_cache
    import dynamo_vars

    clear = dtcompile.base.sharding_cache.clear_sharding_caches
    if stock:
        dtcompile.base.sharding_cache.clear_sharding_caches = lambda: None
    try:
        with dynamo_vars.enabled(not stock):
            results = [check_idiom(item, backend) for item in IDIOMS]
    finally:
        dtcompile.base.sharding_cache.clear_sharding_caches = clear
    return {r.name: r.error for r in results if not r.ok}
