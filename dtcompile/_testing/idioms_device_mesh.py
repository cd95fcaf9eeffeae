"""The DeviceMesh family of the idiom corpus: what training code reads from a mesh and does with it.

Holds :data:`DEVICE_MESH_IDIOMS`: a mesh's attributes (``ndim``, ``device_type``,
``mesh_dim_names``, ``shape``, ``size``), its ranks, coordinates and process
groups, slicing by axis names and flattening, equality and hashing (a mesh as a
dict key), and a mesh passed to a helper, held by a module or read off a DTensor.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from dtcompile._testing.idiom_spec import Idiom, _dt, _global, collector

__all__ = ["DEVICE_MESH_IDIOMS"]

DEVICE_MESH_IDIOMS: list[Idiom] = []
idiom = collector(DEVICE_MESH_IDIOMS)


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
