"""The DTensor API family of the idiom corpus: DTensors made, redistributed and computed with.

Holds :data:`DTENSOR_API_IDIOMS`: ``from_local`` and ``to_local`` (with shape,
stride and gradient placements), ``redistribute`` between every pair of
placements on 1-D and 2-D meshes, ``full_tensor``, attribute reads,
``distribute_tensor``, the factories (``ones``, ``zeros``, ``full``, ``empty``),
local shape and offset, ``implicit_replication``, ``loss_parallel`` inside and
around the compiled region, and backward through DTensor matmuls.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed.tensor as dtensor
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from dtcompile._testing.idiom_spec import Idiom, _dt, _global, collector

__all__ = ["DTENSOR_API_IDIOMS"]

DTENSOR_API_IDIOMS: list[Idiom] = []
idiom = collector(DTENSOR_API_IDIOMS)


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
