"""dtcompile's fused collective-matmul ops (the targets of the ``async_tp`` pass).

- ``dtcompile::fused_all_gather_matmul(A_shard, Bs, gather_dim, group_name)
  -> (A, [A @ B for B in Bs])``: all-gather ``A_shard`` along ``gather_dim``,
  then multiply by each ``B`` (``[K, N]``) on the last dim.
- ``dtcompile::fused_matmul_reduce_scatter(A, B, out_shape, reduce_op,
  scatter_dim, group_name) -> Tensor``: ``(A @ B).view(out_shape)``,
  reduce-scattered along ``scatter_dim``.

Where symmetric memory is available (CUDA, NCCL) they call torch's fused
kernels, ``symm_mem::fused_all_gather_matmul`` / ``fused_matmul_reduce_scatter``,
enabling symmetric memory for the group on first use.  Elsewhere (CPU, gloo,
the fake process group) they run decomposed: all-gather then matmul, matmul then
reduce-scatter, with the functional collectives.  Same values, runs everywhere,
overlaps nothing.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed._functional_collectives as funcol

__all__ = ["fused_all_gather_matmul", "fused_matmul_reduce_scatter", "symmetric_memory_available"]


@functools.cache
def _enable_symm_mem(group_name: str) -> bool:
    try:
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group

        enable_symm_mem_for_group(group_name)
    except Exception:  # noqa: BLE001 - any failure means: use the decomposed path
        return False
    return True


def symmetric_memory_available(tensor: torch.Tensor, group_name: str) -> bool:
    """Whether torch's symmetric-memory fused kernels can run for ``tensor`` on ``group_name``."""
    if not tensor.is_cuda or not hasattr(torch.ops, "symm_mem"):
        return False
    if not hasattr(torch.ops.symm_mem, "fused_all_gather_matmul"):
        return False
    return _enable_symm_mem(group_name)


def _group_size(group_name: str) -> int:
    from torch.distributed import distributed_c10d as c10d

    return c10d._resolve_process_group(group_name).size()


@torch.library.custom_op("dtcompile::fused_all_gather_matmul", mutates_args=())
def fused_all_gather_matmul(
    a_shard: torch.Tensor, bs: list[torch.Tensor], gather_dim: int, group_name: str
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    if symmetric_memory_available(a_shard, group_name):
        a, outs = torch.ops.symm_mem.fused_all_gather_matmul(a_shard, bs, gather_dim, group_name, return_A=True)
        return a, list(outs)
    # Decomposed: gather, then multiply (the same values; no overlap without symmetric memory).
    gathered = funcol.wait_tensor(funcol.all_gather_single(a_shard.contiguous(), gather_dim, group_name))
    return gathered, [torch.matmul(gathered, b) for b in bs]


@fused_all_gather_matmul.register_fake
def _(a_shard, bs, gather_dim, group_name):
    shape = list(a_shard.shape)
    shape[gather_dim] *= _group_size(group_name)
    a = a_shard.new_empty(shape)
    return a, [a.new_empty([*shape[:-1], b.shape[-1]]) for b in bs]


@torch.library.custom_op("dtcompile::fused_matmul_reduce_scatter", mutates_args=())
def fused_matmul_reduce_scatter(
    a: torch.Tensor, b: torch.Tensor, out_shape: list[int], reduce_op: str, scatter_dim: int, group_name: str
) -> torch.Tensor:
    if symmetric_memory_available(a, group_name):
        a_nd = a.view([*out_shape[:-1], a.shape[-1]])
        return torch.ops.symm_mem.fused_matmul_reduce_scatter(a_nd, b, reduce_op, scatter_dim, group_name)
    out = torch.matmul(a, b).view(out_shape)
    return funcol.wait_tensor(funcol.reduce_scatter_single(out, reduce_op, scatter_dim, group_name))


@fused_matmul_reduce_scatter.register_fake
def _(a, b, out_shape, reduce_op, scatter_dim, group_name):
    shape = list(out_shape)
    shape[scatter_dim] //= _group_size(group_name)
    return a.new_empty(shape)
