"""Ops DTensor cannot run, planned anyway: each rank runs them on its local shards.

DTensor dispatches an op only where a sharding strategy is registered for it.
A traced model meets ops without one every day (custom ops, new aten ops, the
CPU variants of ops DTensor handles on CUDA), and the solver still plans them,
with candidates that run the op *outside* DTensor's dispatch, on each rank's
local tensors (:func:`run_local`: ``to_local``, the op, ``from_local`` in the
chosen layouts; autograd's backward goes the same way back, so each input's
gradient comes back in the layout the input was read in):

- **borrowed**: a CPU variant whose twin has DTensor strategies with the same
  semantics takes the twin's strategies (:func:`borrowed_strategies`).
  ``_scaled_dot_product_flash_attention_for_cpu`` computes what
  ``_scaled_dot_product_efficient_attention`` computes (attention per batch
  element and head, an optional additive or boolean mask, its log-sum-exp), so
  it takes that op's strategies as DTensor lists them for the running torch:
  replicated, or sharded on the batch or the heads on each mesh axis.  An
  ``attn_mask`` is sharded like the query where it has that dim, and read whole
  where it broadcasts over it (a size-1 or missing dim).
- **decomposed** (before either): an aten op with neither a strategy nor a twin
  but with a registered decomposition (``torch._decomp``: ``glu``,
  ``hardswish``, ``mse_loss``...) is traced as that decomposition
  (:func:`decomposition_for`, used by :func:`~dtcompile.auto_parallel.trace.trace_forward`),
  whose ops DTensor has strategies for; each of its nodes is planned like any
  other, the replicated layouts among their candidates.
- **replicated** (the fallback, for any op): every input redistributed to
  ``Replicate``, the op run whole on every rank, its outputs ``Replicate``.
  Always valid: each rank computes what the single-device model computes.  It
  is priced like any candidate (the op's whole compute on every rank, measured;
  the gathers on its edges), and offered only where no DTensor strategy of the
  op (or borrowed one) can run.

The solution's explanation marks each node planned this way
(``Solution.local_nodes``), and names each op traced as its decomposition
(``Solution.decomposed``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor, Replicate, Shard

from dtcompile.auto_parallel.placements import Layout

__all__ = ["BORROWED", "REPLICATED", "borrowed_strategies", "decomposition_for", "replicated_strategy", "run_local"]

BORROWED = "borrowed"
"""A candidate's ``local`` value: the strategies of a twin op with the same semantics, run on local shards."""
REPLICATED = "replicated"
"""A candidate's ``local`` value: the fallback, every input replicated and the op run whole on every rank."""


def run_local(op: Any, out_layouts: Sequence[Layout | None], /, *args: Any, **kwargs: Any) -> Any:
    """``op`` on the local tensors of its DTensor arguments, each output wrapped as a DTensor in
    ``out_layouts`` (``None``: returned as it is).  What the applied model calls for a node whose
    chosen candidate runs outside DTensor's dispatch."""
    found = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, DTensor)]
    if not found:
        raise ValueError(f"auto_parallel: run_local({op}) got no DTensor argument; a constant is made whole instead")
    mesh = found[0].device_mesh
    local_args, local_kwargs = pytree.tree_map_only(DTensor, lambda d: d.to_local(), (args, kwargs))
    out = op(*local_args, **local_kwargs)
    outs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
    wrapped = tuple(
        DTensor.from_local(o, mesh, layout, run_check=False) if layout is not None and isinstance(o, torch.Tensor) else o
        for o, layout in zip(outs, out_layouts)
    )
    return wrapped if isinstance(out, (tuple, list)) else wrapped[0]


def replicated_strategy(num_inputs: int, out_metas: Sequence[Any], mesh: Any) -> tuple[tuple[Layout, ...], tuple[Layout | None, ...]]:
    """The fallback's ``(input layouts, output layouts)``: everything replicated."""
    rep = tuple([Replicate()] * mesh.ndim)
    return (rep,) * num_inputs, tuple(rep if m is not None else None for m in out_metas)


def _cpu_flash_as_efficient(
    args: Any, kwargs: Any, tensors: Sequence[tuple[tuple[int, ...], torch.dtype]],
    options: Sequence[Sequence[Layout]], out_shapes: Sequence[tuple[int, ...] | None], mesh: Any,
) -> list[tuple[tuple[Layout, ...], tuple[Layout | None, ...]]]:
    """``_scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, *, attn_mask, scale)``
    planned with DTensor's strategies of ``_scaled_dot_product_efficient_attention`` (no bias;
    the mask follows the query, see the module docstring)."""
    from dtcompile.auto_parallel.strategies import op_strategies

    q, k, v = args[:3]
    dropout_p = args[3] if len(args) > 3 else kwargs.get("dropout_p", 0.0)
    is_causal = args[4] if len(args) > 4 else kwargs.get("is_causal", False)
    if dropout_p:
        return []  # random: each rank would draw its own mask
    twin = torch.ops.aten._scaled_dot_product_efficient_attention.default
    found = op_strategies(
        twin, (q, k, v, None, True, 0.0, is_causal), {"scale": kwargs.get("scale")},
        tensors[:3], options[:3], [out_shapes[0], out_shapes[1], None, None], mesh,
    )
    mask_shape = tensors[3][0] if len(tensors) > 3 else None
    strategies = []
    for ins, outs in found:
        layouts = [*ins[:3]]
        if mask_shape is not None:
            mask = []
            offset = 4 - len(mask_shape)  # the mask broadcasts from the right
            for placement in ins[0]:
                dim = placement.dim - offset if isinstance(placement, Shard) else -1
                sharded = dim >= 0 and mask_shape[dim] == tensors[0][0][placement.dim]
                mask.append(Shard(dim) if sharded else Replicate())
            layouts.append(tuple(mask))
        strategies.append((tuple(layouts), tuple(outs[:2])))
    return strategies


_TWINS = {"_scaled_dot_product_flash_attention_for_cpu.default": _cpu_flash_as_efficient}


def borrowed_strategies(
    op: Any, args: Any, kwargs: Any, tensors: Sequence[tuple[tuple[int, ...], torch.dtype]],
    options: Sequence[Sequence[Layout]], out_shapes: Sequence[tuple[int, ...] | None], mesh: Any,
) -> list[tuple[tuple[Layout, ...], tuple[Layout | None, ...]]]:
    """``(input layouts, output layouts)`` of the twin's strategies, for an op that has a twin
    (see the module docstring); ``[]`` for any other op."""
    twin = _TWINS.get(f"{getattr(op, '_opname', '')}.{getattr(op, '_overloadname', '')}")
    if twin is None or getattr(op, "namespace", "") != "aten":
        return []
    return twin(args, kwargs, tensors, options, out_shapes, mesh)


def decomposition_for(op: Any) -> Any:
    """The registered decomposition of an aten op DTensor cannot run and no twin lends
    strategies to; ``None`` for any other op (see the module docstring)."""
    from torch._decomp import decomposition_table

    from dtcompile.auto_parallel.strategies import has_strategy

    if not isinstance(op, torch._ops.OpOverload) or op.namespace != "aten" or has_strategy(op):
        return None
    if f"{op._opname}.{op._overloadname}" in _TWINS:
        return None
    return decomposition_table.get(op)
