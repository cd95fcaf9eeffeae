"""dtcompile's fused collective-matmul ops (the targets of the ``async_tp`` pass).

- ``dtcompile::fused_all_gather_matmul(A_shard, Bs, gather_dim, group_name)
  -> (A, [A @ B for B in Bs])``: all-gather ``A_shard`` along ``gather_dim``,
  then multiply by each ``B`` (``[K, N]``) on the last dim.
- ``dtcompile::fused_matmul_reduce_scatter(A, B, out_shape, reduce_op,
  scatter_dim, group_name) -> Tensor``: ``(A @ B).view(out_shape)``,
  reduce-scattered along ``scatter_dim``.

Where symmetric memory is available (CUDA tensors on an NCCL group) they call
torch's fused kernels, ``symm_mem::fused_all_gather_matmul`` /
``fused_matmul_reduce_scatter``, enabling symmetric memory for the group on
first use (and allocating its workspace, so that a machine that cannot map
symmetric memory is found out there).  Elsewhere (CPU, gloo, the fake process
group), or when enabling fails, they run decomposed: all-gather then matmul,
matmul then reduce-scatter, with the functional collectives.  Same values, runs
everywhere, overlaps nothing.  Why a group runs decomposed is logged once per
group (``logging.getLogger("dtcompile.base.fused_ops")``).
"""

from __future__ import annotations

import functools
import logging
import warnings

import torch

__all__ = ["decomposed_on", "fused_all_gather_matmul", "fused_matmul_reduce_scatter", "symmetric_memory_available"]

log = logging.getLogger(__name__)
_c10d = torch.ops._c10d_functional


@functools.cache
def _enable_symm_mem(group_name: str) -> bool:
    """Enables symmetric memory for the group once; on failure logs why, once, and returns False."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    backend = str(dist.get_backend(c10d._resolve_process_group(group_name)))
    if "nccl" not in backend:
        # The fake and gloo groups have no peers' memory to map (a fake group's
        # store holds nothing, so a rendezvous there would never complete).
        log.info(
            "symmetric memory is not used for process group %r: its backend is %r, not nccl; "
            "the fused collective-matmul ops run decomposed",
            group_name,
            backend,
        )
        return False
    try:
        # Importing it defines the symm_mem::fused_* ops (in Python).
        from torch.distributed import _symmetric_memory as symm_mem

        missing = [
            name
            for name in ("fused_all_gather_matmul", "fused_matmul_reduce_scatter")
            if not hasattr(torch.ops.symm_mem, name)
        ]
        if missing:
            raise RuntimeError(f"this torch has no symm_mem::{', '.join(missing)}")
        with warnings.catch_warnings():
            # Deprecated (a no-op need) in newer torch, required by older ones.
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem.enable_symm_mem_for_group(group_name)
        # The workspace the fused kernels use: a rendezvous of the group's ranks,
        # where a device that cannot map symmetric memory fails.
        symm_mem.get_symm_mem_workspace(group_name, min_size=1)
    except Exception as exc:  # noqa: BLE001 - any failure means: use the decomposed path
        log.warning(
            "symmetric memory could not be enabled for process group %r (%s: %s); "
            "the fused collective-matmul ops run decomposed (all-gather then matmul, "
            "matmul then reduce-scatter)",
            group_name,
            type(exc).__name__,
            exc,
        )
        return False
    return True


def decomposed_on(device_type: str, group_name: str) -> str | None:
    """Why the fused ops would run decomposed on a CUDA device over ``group_name``, or None.

    At compile time (no rendezvous): on CUDA the fused kernels need an NCCL
    group; on another group (the fake process group, gloo) the ops would run
    decomposed, which on a GPU only adds host time and overlaps nothing.  CPU
    graphs always run decomposed (there is no fused CPU kernel) and are not
    asked about: the decomposition is what CPU tests and gloo runs exercise.
    """
    if device_type != "cuda":
        return None
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    backend = str(dist.get_backend(c10d._resolve_process_group(group_name)))
    if "nccl" in backend:
        return None
    return f"group {group_name} is a {backend} group: on cuda the fused kernels need nccl (symmetric memory)"


def symmetric_memory_available(tensor: torch.Tensor, group_name: str) -> bool:
    """Whether torch's symmetric-memory fused kernels can run for ``tensor`` on ``group_name``."""
    if not tensor.is_cuda:
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
        # The kernel gathers on dim 0 and moves the dim back: for gather_dim > 0 its
        # results are not contiguous, but this op's fake (what Inductor plans
        # with) and its decomposed path are.
        return a.contiguous(), [out.contiguous() for out in outs]
    # Decomposed: gather, then multiply (the same values; no overlap without symmetric memory).
    # The raw functional ops: funcol's eager wrappers (AsyncCollectiveTensor) cost
    # CPU time that, at the start of a graph, the GPU waits for.
    size = _group_size(group_name)
    gathered = _c10d.wait_tensor(_c10d.all_gather_into_tensor(a_shard.contiguous(), size, group_name))
    if gather_dim != 0:  # the ranks' shards are stacked on dim 0
        gathered = torch.cat(gathered.chunk(size), dim=gather_dim)
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
        a_nd = a.reshape([*out_shape[:-1], a.shape[-1]])
        return torch.ops.symm_mem.fused_matmul_reduce_scatter(a_nd, b, reduce_op, scatter_dim, group_name).contiguous()
    # Decomposed: multiply, then reduce-scatter.  The collective wants each rank's
    # chunk (of ``scatter_dim``) as one block of rows: for a leading dim, reorder
    # the rows of ``a`` (K wide) rather than the product's (N wide, as wide or
    # wider in a TP block).
    size = _group_size(group_name)
    shape = list(out_shape)
    dim = scatter_dim % len(shape)
    if size > 1 and 0 < dim < len(shape) - 1:
        a = a.reshape(*shape[:dim], size, shape[dim] // size, *shape[dim + 1 : -1], a.shape[-1])
        product = torch.matmul(a.movedim(dim, 0).reshape(-1, a.shape[-1]), b)
    elif size > 1 and dim == len(shape) - 1:  # the product's columns
        product = torch.cat(torch.matmul(a, b).view(shape).chunk(size, dim=dim))
    else:
        product = torch.matmul(a, b)
    out = _c10d.wait_tensor(_c10d.reduce_scatter_tensor(product, reduce_op.lower(), size, group_name))
    shape[dim] //= size
    return out.view(shape)


@fused_matmul_reduce_scatter.register_fake
def _(a, b, out_shape, reduce_op, scatter_dim, group_name):
    shape = list(out_shape)
    shape[scatter_dim] //= _group_size(group_name)
    return a.new_empty(shape)
