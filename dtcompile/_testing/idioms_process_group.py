"""The ProcessGroup family of the idiom corpus: a mesh's process groups and the functional collectives.

Holds :data:`PROCESS_GROUP_IDIOMS`: a group's rank, size and name,
``torch.distributed``'s queries on a group and on ``group.WORLD``, and the
functional collectives (``all_reduce``, ``all_gather_tensor``,
``reduce_scatter_tensor``, ``all_gather_tensor_autograd``) on a group, a mesh or
one mesh axis.
"""

from __future__ import annotations

import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from dtcompile._testing.idiom_spec import Idiom, _global, collector

__all__ = ["PROCESS_GROUP_IDIOMS"]

PROCESS_GROUP_IDIOMS: list[Idiom] = []
idiom = collector(PROCESS_GROUP_IDIOMS)


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
