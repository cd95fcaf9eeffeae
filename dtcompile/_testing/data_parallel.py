"""Data parallelism for the shared models: parameters stored as DTensors, gathered for compute.

Holds ``_data_parallel``, which stores every parameter of a model as a DTensor
on the mesh, ``Shard(0)`` (FSDP) or ``Replicate()`` (DDP) over the data-parallel
axis and any tensor-parallel placements kept on the others; the
parametrization it registers, ``_GatherForCompute`` (SimpleFSDP's
``ReplicateComputation``); and :func:`parallelize_simple_fsdp`, SimpleFSDP on
any model.  The per-model plans built on it (``parallelize_fsdp_mlp``,
``parallelize_gathered_stack``, ``parallelize_block_2d``) sit with their models.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard
from torch.nn.utils import parametrize

__all__ = ["parallelize_simple_fsdp"]


class _GatherForCompute(nn.Module):
    """Parametrization: the stored DTensor parameter, redistributed for compute.

    Forward redistributes the stored parameter to ``compute_placements`` and hands
    the module a DTensor on ``compute_mesh`` (or a plain tensor when that is None).
    Backward follows from ``to_local(grad_placements=...)``: the gradient is
    ``Partial("avg")`` over the data-parallel axis, so redistributing it back to
    the stored placements reduce-scatters (sharded) or all-reduces (replicated).
    This is SimpleFSDP's ``ReplicateComputation``.

    With ``reduce_gradient=False`` the gradient keeps ``to_local``'s default
    placements (``Replicate``): each rank's gradient is sliced back to its own
    shard, unreduced.
    """

    def __init__(self, dp_axis: int, compute_mesh: DeviceMesh | None, reduce_gradient: bool = True) -> None:
        super().__init__()
        self.dp_axis = dp_axis
        self.compute_mesh = compute_mesh
        self.reduce_gradient = reduce_gradient

    def forward(self, stored: DTensor) -> torch.Tensor:
        placements = list(stored.placements)
        placements[self.dp_axis] = Replicate()
        grad_placements = list(placements)
        grad_placements[self.dp_axis] = Partial("avg")
        local = stored.redistribute(placements=placements).to_local(
            grad_placements=grad_placements if self.reduce_gradient else None
        )
        if self.compute_mesh is None:
            return local
        del placements[self.dp_axis]
        return DTensor.from_local(local, self.compute_mesh, placements, run_check=False)


def _data_parallel(
    model: nn.Module, mesh: DeviceMesh, *, shard: bool, dp_axis: int = 0, reduce_gradients: bool = True
) -> nn.Module:
    """Stores every parameter as a DTensor on ``mesh``, data parallel over ``dp_axis``.

    With ``shard=True`` the stored parameter is ``Shard(0)`` over ``dp_axis``
    (FSDP: all-gather in forward, reduce-scatter in backward), otherwise
    ``Replicate()`` (DDP: all-reduce in backward).  Parameters that already are
    DTensors on a sub-mesh of ``mesh`` (tensor parallel) keep their placements on
    the other axes and come back to the module as DTensors on that sub-mesh.
    Sharded, such a parameter's ``dp_axis`` shards its tensor-parallel shard
    (FSDP2's layout): ``_StridedShard(0)`` where a tensor-parallel axis shards dim 0 too.
    """
    for module in list(model.modules()):
        for name, param in list(module.named_parameters(recurse=False)):
            if isinstance(param, DTensor):
                compute_mesh = param.device_mesh
                placements = list(param.placements)
                local = param.to_local()
            else:
                compute_mesh = None
                placements, local = [], param.data
            dp_placement: Placement = Replicate()
            if shard:
                split = math.prod(
                    compute_mesh.size(axis) for axis, p in enumerate(placements) if p.is_shard(0)
                ) if compute_mesh is not None else 1
                dp_placement = Shard(0) if split == 1 else _StridedShard(0, split_factor=split)
            placements.insert(dp_axis, dp_placement)
            if shard and compute_mesh is None:
                stored = distribute_tensor(local.detach(), mesh, placements)
            elif shard:
                own = local.detach().chunk(mesh.size(dp_axis))[mesh.get_local_rank(dp_axis)]
                stored = DTensor.from_local(own, mesh, placements, run_check=False)
            else:
                stored = DTensor.from_local(local.detach(), mesh, placements, run_check=False)
            setattr(module, name, nn.Parameter(stored))
            parametrize.register_parametrization(
                module, name, _GatherForCompute(dp_axis, compute_mesh, reduce_gradients), unsafe=True
            )
    return model


def parallelize_simple_fsdp(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """SimpleFSDP: every parameter ``Shard(0)`` over the mesh, gathered in forward,
    gradients reduce-scattered (the same as :func:`parallelize_fsdp_mlp`, any model)."""
    return _data_parallel(model, mesh, shard=True)
