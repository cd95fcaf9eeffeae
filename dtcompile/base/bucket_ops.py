"""The copies into and out of a bucket's buffer (the targets of the ``bucketing`` pass).

- ``dtcompile::pack_columns(tensors, rows) -> Tensor``: each tensor viewed as ``rows`` rows,
  the rows concatenated side by side and flattened: the buffer a bucketed collective sends
  (``rows=1``: the tensors one after the other, for an all-gather or an all-reduce;
  ``rows=group_size``: rank ``r``'s chunk holds its rows of every tensor, for a
  reduce-scatter).
- ``dtcompile::unpack_columns(rows, offsets, widths) -> Tensor[]``: columns
  ``offset:offset + width`` of a ``[rows, total]`` tensor, each copied out contiguous: a
  member's piece of a bucketed all-gather's result (rank ``r``'s shard of it in row ``r``).

Why ops of their own, where ``cat``, ``slice`` and ``reshape`` compute the same values:
Inductor generates a kernel for each copy with the member's offset in the bucket written into
its source, and fuses some of them into their neighbours (a norm and its weight's copy), so
that every member of every bucket has a kernel of its own.  A model's repeated layers then
compile no kernel once for all of them, and a cold compile grows by a C++ or Triton kernel
per parameter (issue #70: 96 C++ kernels against stock's 18 at 8 Llama3 layers, 2.9x its
seconds).  As ops, Inductor calls them as they are (an extern kernel each, as FSDP2 calls its
own copy-in and copy-out), and the layers' kernels are the same again.  They compute on this
rank and issue nothing (:func:`~dtcompile.base.op_facts.is_ordering_barrier`: not barriers).
"""

from __future__ import annotations

import itertools

import torch

__all__ = ["pack_columns", "unpack_columns"]


@torch.library.custom_op("dtcompile::pack_columns", mutates_args=())
def pack_columns(tensors: list[torch.Tensor], rows: int) -> torch.Tensor:
    if all(t.dim() and t.shape[0] % rows == 0 for t in tensors):
        # FSDP2's copy-in for its reduce-scatter: one kernel on CUDA.
        return torch._chunk_cat(tensors, dim=0, num_chunks=rows).reshape(-1)
    return torch.cat([t.reshape(rows, -1) for t in tensors], dim=1).reshape(-1)


@pack_columns.register_fake
def _(tensors, rows):
    return tensors[0].new_empty([sum(t.numel() for t in tensors)])


@torch.library.custom_op("dtcompile::unpack_columns", mutates_args=())
def unpack_columns(rows: torch.Tensor, offsets: list[int], widths: list[int]) -> list[torch.Tensor]:
    if offsets == list(itertools.accumulate(widths, initial=0))[:-1] and sum(widths) == rows.shape[1]:
        # Every column, in order: FSDP2's copy-out for its all-gather, one kernel on CUDA.
        outs = [rows.new_empty((rows.shape[0], width)) for width in widths]
        torch.split_with_sizes_copy(rows, widths, dim=1, out=outs)
        return outs
    # clone, not contiguous(): an op's results may not alias its input (one row is contiguous).
    return [
        rows[:, offset : offset + width].clone(memory_format=torch.contiguous_format)
        for offset, width in zip(offsets, widths, strict=True)
    ]


@unpack_columns.register_fake
def _(rows, offsets, widths):
    return [rows.new_empty([rows.shape[0], width]) for width in widths]
