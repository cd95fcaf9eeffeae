"""The candidate strategies of one op: DTensor's own registered strategies, kept where DTensor runs them.

For an op node the solver asks DTensor's sharding propagator for the op's
``OpStrategy`` given input ``OpStrategy``\\ s that list every layout the producers
may give (:func:`op_strategies`): the op's single-mesh-dim strategies expanded
over the mesh (``_expand_single_dim_strategy_to_mesh``, the path DTensor's
dispatch takes first), else its registered strategy function
(``op_strategy_funcs``).  Each ``OpSpec`` is one candidate: input layouts, output
layouts.

A candidate is kept only if it shards every tensor evenly, with ``Shard``,
``Replicate`` and ``Partial`` placements only, and DTensor, handed
inputs in exactly those layouts, runs that very strategy: no communication
before the op and the same output layouts (DTensor breaks ties between
strategies its own way).  The problem checks that on the measured run
(:func:`dtcompile.auto_parallel.measure.measure_op`), where DTensor's dispatch
makes the decision itself.  A strategy that reads a ``Partial`` input is
also offered with that input handed over replicated, where DTensor's dispatch
makes it ``Partial`` locally (an explicit ``redistribute`` may not: the
row-wise linear's bias).  So the applied model, which redistributes each
input to the chosen layout before the op, makes DTensor run the chosen strategy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.distributed.tensor import Partial, Replicate, Shard

from dtcompile.auto_parallel.measure import _global_stride, _TensorSlot
from dtcompile.auto_parallel.placements import Layout, even

__all__ = ["UnsupportedOp", "has_strategy", "op_strategies"]


class UnsupportedOp(ValueError):
    """DTensor has no sharding strategy for an op of the traced model."""


def _propagator() -> Any:
    from torch.distributed.tensor import DTensor

    return DTensor._op_dispatcher.sharding_propagator


def has_strategy(op: Any) -> bool:
    """Whether DTensor's dispatch can run ``op``: a registered strategy, or a custom handler."""
    from torch.distributed.tensor import DTensor

    propagator = _propagator()
    return (
        op in propagator.op_strategy_funcs
        or op in propagator.op_single_dim_strategy_funcs
        or op in DTensor._op_dispatcher._custom_op_handlers
    )


def _meta(shape: Sequence[int], dtype: torch.dtype) -> Any:
    from torch.distributed.tensor._dtensor_spec import TensorMeta

    return TensorMeta(torch.Size(shape), _global_stride(shape), dtype)


def _schema(op: Any, args: Any, kwargs: Any, fill: Any) -> Any:
    from torch.distributed.tensor._op_schema import OpSchema

    propagator = _propagator()
    info = propagator.op_to_schema_info.get(op) or propagator.op_to_schema_info_for_single_dim_strategy.get(op)
    call_args, call_kwargs = pytree.tree_map_only(_TensorSlot, fill, (args, kwargs))
    return OpSchema(op, tuple(call_args), dict(call_kwargs), schema_info=info)


def _layouts_of(specs: Any) -> tuple[Layout | None, ...]:
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    if isinstance(specs, DTensorSpec):
        return (tuple(specs.placements),)
    return tuple(tuple(s.placements) if isinstance(s, DTensorSpec) else None for s in specs)


def op_strategies(
    op: Any,
    args: Any,
    kwargs: Any,
    tensors: Sequence[tuple[tuple[int, ...], torch.dtype]],
    options: Sequence[Sequence[Layout]],
    out_shapes: Sequence[tuple[int, ...] | None],
    mesh: Any,
) -> list[tuple[tuple[Layout, ...], tuple[Layout | None, ...]]]:
    """``(input layouts, output layouts)`` of every strategy DTensor lists for ``op`` when
    tensor argument ``i`` may come in any layout of ``options[i]``; kept only where
    every input and output shards evenly."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor._op_schema import OpSpec, OpStrategy

    propagator = _propagator()
    metas = [_meta(shape, dtype) for shape, dtype in tensors]

    def first_spec(slot: _TensorSlot) -> Any:
        return DTensorSpec(mesh, tuple(options[slot.index][0]), tensor_meta=metas[slot.index])

    single = propagator.op_single_dim_strategy_funcs.get(op)
    if single is None and op not in propagator.op_strategy_funcs:
        raise UnsupportedOp(f"{op}: DTensor has no registered sharding strategy for it")

    def strategies_for(opts: Sequence[Sequence[Layout]]) -> list[Any]:
        def strategy(slot: _TensorSlot) -> Any:
            meta = metas[slot.index]
            return OpStrategy([OpSpec(DTensorSpec(mesh, tuple(layout), tensor_meta=meta)) for layout in opts[slot.index]])

        if single is not None:
            # The expansion lists every combination of the op's rules whatever the inputs'
            # layouts (only its redistribution costs, unused here, read them): one each.
            schema = _schema(op, args, kwargs, lambda slot: OpStrategy([OpSpec(first_spec(slot))]))
            out_meta = propagator._propagate_tensor_meta_non_cached(_schema(op, args, kwargs, first_spec))
            return _expand_single_dim(op, schema, single, out_meta, opts, len(tensors), mesh).strategies
        return propagator.op_strategy_funcs[op](_schema(op, args, kwargs, strategy)).strategies

    try:
        specs = strategies_for(options)
    except Exception:
        # Some strategy functions (views) raise for one input layout instead of leaving it
        # out: ask once per layout of the first input and keep what DTensor answers.
        specs = []
        for layout in options[0]:
            try:
                specs += strategies_for([[layout], *options[1:]])
            except Exception:
                continue
    found: dict[tuple[Any, Any], None] = {}
    for spec in specs:
        ins = spec.input_specs if spec.input_specs is not None else (spec.output_spec,) * len(tensors)
        in_layouts = tuple(tuple(s.placements) for s in ins)
        out_layouts = _layouts_of(spec.output_specs)
        if len(in_layouts) != len(tensors):
            continue
        # Only Shard, Replicate and Partial: sizes, costs and redistributions here know no other
        # placement (a view's _StridedShard is left out; see docs/limits.md).
        if not all(isinstance(p, (Shard, Replicate, Partial)) for layout in (*in_layouts, *out_layouts)
                   if layout is not None for p in layout):
            continue
        if not all(even(shape, layout, mesh.shape) for (shape, _), layout in zip(tensors, in_layouts)):
            continue
        if not all(
            shape is None or layout is None or even(shape, layout, mesh.shape)
            for shape, layout in zip(out_shapes, out_layouts)
        ):
            continue
        found[(in_layouts, out_layouts)] = None
        if any(isinstance(p, Partial) for layout in in_layouts for p in layout):
            # Handed replicated where the strategy reads Partial: DTensor's dispatch makes it
            # Partial itself (a local step an explicit redistribute may not take), as it does
            # for a row-wise linear's replicated bias.
            handed = tuple(tuple(Replicate() if isinstance(p, Partial) else p for p in layout) for layout in in_layouts)
            found[(handed, out_layouts)] = None
    return list(found)


def _expand_single_dim(op: Any, schema: Any, single: Any, out_meta: Any, options: Sequence[Sequence[Layout]],
                       num_inputs: int, mesh: Any) -> Any:
    """DTensor's single-mesh-dim strategies of ``op`` expanded over the mesh.

    DTensor's own expansion (``_expand_single_dim_strategy_to_mesh``) fills the
    strategies' shard placeholders with the shardings its one runtime input
    layout uses; here the inputs may come in any layout, so the placeholders are
    filled with every placement the options use, then expanded the same way
    (``expand_to_full_mesh_op_strategy``).
    """
    from torch.distributed.tensor._dtensor_spec import TensorMeta
    from torch.distributed.tensor._ops.single_dim_strategy import (
        _fill_single_dim_strategy_placeholders,
        _insert_single_dim_replication_strategy,
    )
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy

    rules = single.func(op, schema.args_meta, schema.kwargs_meta)
    if rules:
        num_outputs = len(rules[0]) - num_inputs
    else:
        num_outputs = 1 if isinstance(out_meta, TensorMeta) else len(out_meta or ())
    rules = _insert_single_dim_replication_strategy(rules, num_outputs, num_inputs, out_meta)
    used = {p for layouts in options for layout in layouts for p in layout}
    rules = _fill_single_dim_strategy_placeholders(used, rules)
    return expand_to_full_mesh_op_strategy(
        mesh, schema, rules, output_tensor_meta=out_meta, input_index=num_outputs, allow_uneven_sharding=False
    )
