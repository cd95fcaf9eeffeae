"""DTensor's answers to the planner's questions, kept per what they read while a plan is built.

DTensor decides how to run an op by expanding its single-mesh-dim strategies
over the mesh (``expand_to_full_mesh_op_strategy``: every combination, one
``DTensorSpec`` each, each input's redistribution cost from the layout it
arrives in) and taking the cheapest.  Its sharding cache is keyed by the
inputs' layouts, and the planner hands every op each layout its candidates
read: on a cold plan nearly every question is new, and the expansion was most
of planning (Llama on 2 x 2, under cProfile: 913 expansions, 12.5 of 23.7 s,
most of it building the same specs again).

What the expansion lists does not depend on the inputs' layouts; only the
costs do.  While :func:`kept_expansions` is held, an expansion is computed once
per question that can differ (the mesh, the op, its inputs' and outputs'
shapes, the filled single-dim strategies) and each later call builds only the
costs, in DTensor's order, with DTensor's own ``redistribute_cost``, itself kept
per what it reads (:func:`_cost`), once per input and source layout; DTensor then
selects as it always does.  The same kept cost answers DTensor's other strategy
functions, and the steps that cost reads (its planner's ``_gen_transform_infos``)
are asked once per layouts where they do not depend on the shape (:func:`_kept_steps`).  The
answer is the one DTensor computes: a call whose result may depend on its
inputs' layouts beyond the costs goes to DTensor's own expansion, namely one
that writes in place, fills an ``out=`` argument, filters candidates with the
op's own rule, reads an argument from another mesh, or has an input that is
``_StridedShard`` or unevenly sharded (where an uneven strategy is allowed only
if it is what arrives).  DTensor's output metadata of an op (which it computes
on fake tensors of the global shapes, in a new fake mode each time) is kept per
op and global shapes too.  ``tests/auto_parallel/test_expansion.py`` checks that
problems built with and without them are equal.

A :class:`~dtcompile.base.scoped_patch.ScopedPatch`: the module attributes and the
propagator's method DTensor calls are replaced while some plan holds them, for
every thread; they answer every caller as DTensor would, so one that is not
planning gets the same result.  What they kept is let go when the last plan ends.
"""

from __future__ import annotations

import collections
import itertools
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dtcompile.auto_parallel.measure import steps_ignore_shape
from dtcompile.auto_parallel.placements import is_strided
from dtcompile.base.scoped_patch import ScopedPatch

__all__ = ["kept_expansions"]

_KEPT = 4096  # expansions kept while held (a one-layer model asks for about 150)
# The keyword arguments whose values are part of an expansion's key; any other (a newer
# torch's) sends the call to DTensor's own expansion.
_KEYED = {"output_tensor_meta", "input_index", "allow_unbacked_sharding", "allow_uneven_sharding"}
_PASSED_ON = {"inplace_op", "full_mesh_strategy_filter", "is_valid_strategy_cb", "different_mesh_args"}

_lock = threading.Lock()
_expansions: collections.OrderedDict[Any, _Listed] = collections.OrderedDict()
_ids: dict[Any, int] = {}  # a spec's facts (see _facts) -> a number, hashed at once
_costs: dict[tuple[int, int], float] = {}  # (source's facts, target's) -> DTensor's cost
# (an expansion, an input, the source's facts) -> the costs of each of its strategies
_columns: dict[tuple[int, int, int], tuple[float, ...]] = {}
_metas: dict[Any, Any] = {}
_steps: dict[Any, Any] = {}  # (layouts, meshes) -> DTensor's greedy steps, read by its cost
_pricing = threading.local()  # .on: this thread is in DTensor's redistribute_cost (see _cost)
_numbers = itertools.count()


@dataclass(frozen=True)
class _Listed:
    """An expansion as kept: per strategy its output and input specs, and per input the
    numbers of each strategy's input spec's facts (as a target of ``redistribute_cost``)."""

    number: int
    outputs: list[Any]
    inputs: list[list[Any]]
    targets: list[tuple[int, ...]]


def _hashable(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(v) for v in value)
    return value


def _greedy(spec: Any) -> bool:
    """Whether DTensor's greedy planner takes ``spec``'s redistributions, whose steps are the
    same whatever the shape (:func:`~dtcompile.auto_parallel.measure.steps_ignore_shape`, in
    the default shard order)."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    return (
        spec.tensor_meta is not None and steps_ignore_shape(spec.placements)
        and DTensorSpec.is_default_device_order(getattr(spec, "shard_order", None))
    )


def _facts(spec: Any) -> tuple[Any, Any]:
    """What DTensor's ``redistribute_cost`` reads of ``spec`` as source or target: its layout,
    mesh (the object too: meshes compare equal before and after ``_flatten``) and bytes; and
    its shape and shard order where its redistribution's steps may depend on them (see
    :func:`_cost`)."""
    meta = spec.tensor_meta
    layout = (tuple(spec.placements), spec.mesh, id(spec.mesh), None if meta is None else math.prod(meta.shape) * meta.dtype.itemsize)
    return layout, None if _greedy(spec) else (meta, getattr(spec, "shard_order", None))


def _number(facts: Any) -> int:
    with _lock:
        return _ids.setdefault(facts, len(_ids))


def _source(spec: Any) -> int:
    """The number of ``spec``'s facts as a source of ``redistribute_cost``: all of them."""
    return _number(_facts(spec))


def _target(spec: Any) -> int:
    """The number of ``spec``'s facts as a target: its bytes are not read."""
    layout, steps = _facts(spec)
    return _number(("target", layout[:3], steps))


def _cost(src: Any, src_number: int, dst: Any, dst_number: int) -> float:
    """DTensor's ``redistribute_cost(src, dst)``, kept by what it reads: the layouts, meshes and
    the bytes of ``src``, and the steps of the redistribution, which DTensor's greedy planner
    takes whatever the shape (:func:`~dtcompile.auto_parallel.measure._transform_steps`); where
    it searches instead (``_StridedShard``, a shard order of its own), the shapes too.  Its
    steps are asked of DTensor once per layouts (see :func:`_kept_steps`)."""
    cost = _costs.get((src_number, dst_number))
    if cost is None:
        from torch.distributed.tensor._collective_utils import redistribute_cost

        _pricing.on = True
        try:
            cost = _costs[src_number, dst_number] = redistribute_cost(src, dst)
        finally:
            _pricing.on = False
    return cost


def _kept_cost(current_spec: Any, target_spec: Any) -> float:
    """DTensor's ``redistribute_cost``, kept (:func:`_cost`): what its strategy functions
    call while a plan is being built."""
    return _cost(current_spec, _source(current_spec), target_spec, _target(target_spec))


def _kept_steps(original: Callable[..., Any]) -> Callable[..., Any]:
    """DTensor's ``_gen_transform_infos``, which on a thread pricing a redistribution
    (:func:`_cost`) answers a pair its greedy planner takes from the steps it gave the first
    pair of the same layouts on the same mesh: only each step's ``logical_shape`` differs
    with the shape, and ``redistribute_cost`` reads the placements and mesh dims alone.  Any
    other caller (a redistribution, which reads the shapes) gets DTensor's own answer."""

    def _gen_transform_infos(src_spec: Any, dst_spec: Any, use_graph_based_transform: bool | None = None) -> Any:
        if not getattr(_pricing, "on", False) or use_graph_based_transform is not None:
            return original(src_spec, dst_spec, use_graph_based_transform)
        if not (_greedy(src_spec) and _greedy(dst_spec)):
            return original(src_spec, dst_spec)
        key = (src_spec.placements, dst_spec.placements, src_spec.mesh, id(src_spec.mesh), dst_spec.mesh, id(dst_spec.mesh))
        with _lock:
            found = _steps.get(key)
        if found is None:
            found = original(src_spec, dst_spec)
            with _lock:
                _steps[key] = found
        return found

    _gen_transform_infos.cache_clear = original.cache_clear  # type: ignore[attr-defined]
    _gen_transform_infos.__wrapped__ = original  # type: ignore[attr-defined]
    return _gen_transform_infos


def _key(mesh: Any, op_schema: Any, rules: Any, kwargs: dict[str, Any], inputs: list[Any]) -> Any | None:
    """What the expansion's list depends on, or ``None`` where it may depend on more (see the module)."""
    from torch.distributed.tensor._ops.utils import is_tensor_shardable

    if kwargs.get("inplace_op") or kwargs.get("full_mesh_strategy_filter") is not None:
        return None
    if kwargs.get("is_valid_strategy_cb") is not None:  # torch 2.13's name for that filter
        return None
    if kwargs.get("different_mesh_args") is not None or not set(kwargs) <= _KEYED | _PASSED_ON:
        return None
    if op_schema.is_out_variant_op():
        return None
    specs = [strategy.strategies[0].output_spec for strategy in inputs]
    if any(is_strided(p) for spec in specs for p in spec.placements):
        return None
    # An input sharded evenly: a strategy whose layouts it arrives in is kept for the shapes'
    # sake alone, so allow_uneven_sharding changes nothing.
    if not all(is_tensor_shardable(strategy.shape, spec) for strategy, spec in zip(inputs, specs)):
        return None
    return (
        mesh, id(mesh), op_schema.op, tuple(strategy.tensor_meta for strategy in inputs), len(op_schema.args_strategy),
        _hashable(rules), tuple(sorted((k, _hashable(kwargs[k])) for k in _KEYED if k in kwargs)),
    )


def _kept(original: Callable[..., Any]) -> Callable[..., Any]:
    from torch.distributed.tensor._op_schema import OpSpec, OpStrategy

    def expand_to_full_mesh_op_strategy(mesh: Any, op_schema: Any, single_mesh_dim_strategies: Any, **kwargs: Any) -> Any:
        inputs = op_schema.args_strategy + op_schema.kwargs_strategy
        key = _key(mesh, op_schema, single_mesh_dim_strategies, kwargs, inputs)
        with _lock:
            listed = None if key is None else _expansions.get(key)
            if listed is not None:
                _expansions.move_to_end(key)
        if listed is None:
            expanded = original(mesh, op_schema, single_mesh_dim_strategies, **kwargs)
            if key is not None:
                strategies = expanded.strategies
                kept = _Listed(
                    next(_numbers), [s.output_specs for s in strategies], [list(s.input_specs) for s in strategies],
                    [tuple(_target(s.input_specs[i]) for s in strategies) for i in range(len(inputs))],
                )
                with _lock:
                    _expansions[key] = kept
                    while len(_expansions) > _KEPT:
                        _expansions.popitem(last=False)
            return expanded
        # Per input, per source: the cost of each strategy's input spec from it.
        columns = []
        for i, strategy in enumerate(inputs):
            from_input = []
            for source in strategy.strategies:
                src = source.output_spec
                src_number = _source(src)
                column = _columns.get((listed.number, i, src_number))
                if column is None:
                    column = _columns[listed.number, i, src_number] = tuple(
                        _cost(src, src_number, ins[i], dst_number)
                        for ins, dst_number in zip(listed.inputs, listed.targets[i])
                    )
                from_input.append(column)
            columns.append(from_input)
        return OpStrategy([
            OpSpec(
                output_specs=outs, input_specs=list(ins),
                redistribute_cost=[[column[j] for column in from_input] for from_input in columns],
            )
            for j, (outs, ins) in enumerate(zip(listed.outputs, listed.inputs))
        ])

    expand_to_full_mesh_op_strategy.__wrapped__ = original  # type: ignore[attr-defined]
    return expand_to_full_mesh_op_strategy


def _meta_key(op_schema: Any) -> Any | None:
    """The op and its arguments with each tensor's spec reduced to its global metadata (all that
    DTensor's output-metadata propagation reads of it); ``None`` where that is not hashable."""
    import torch.utils._pytree as pytree
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    leaves, tree = pytree.tree_flatten((op_schema.args_schema, op_schema.kwargs_schema))
    key = (op_schema.op, tree, tuple((DTensorSpec, v.tensor_meta) if isinstance(v, DTensorSpec) else v for v in leaves))
    try:
        hash(key)
    except TypeError:  # a symbolic size, a list argument pytree keeps as a leaf
        return None
    return key


def _kept_metas(original: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def _propagate_tensor_meta_non_cached(op_schema: Any) -> Any:
        key = _meta_key(op_schema)
        if key is None:
            return original(op_schema)
        with _lock:
            found = _metas.get(key, _metas)  # (_metas: not kept yet; None is an answer)
        if found is _metas:
            found = original(op_schema)
            with _lock:
                _metas[key] = found
        return list(found) if isinstance(found, list) else found

    return _propagate_tensor_meta_non_cached


def _keep_expansions() -> Callable[[], None]:
    import torch.distributed.tensor._ops.utils as utils
    import torch.distributed.tensor._redistribute as redistribute
    from torch.distributed.tensor import DTensor

    original = utils.expand_to_full_mesh_op_strategy
    utils.expand_to_full_mesh_op_strategy = _kept(original)
    # The costs DTensor's strategy functions ask (generate_redistribute_costs reads the name
    # in its module), and the steps its cost reads.
    cost = utils.redistribute_cost
    utils.redistribute_cost = _kept_cost
    steps = redistribute._gen_transform_infos
    redistribute._gen_transform_infos = _kept_steps(steps)
    # DTensor's output metadata of an op (made in a fresh FakeTensorMode each time): from the
    # inputs' global shapes alone.  Bound on the one propagator DTensor dispatches through.
    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator._propagate_tensor_meta_non_cached = _kept_metas(propagator._propagate_tensor_meta_non_cached)

    def undo() -> None:
        utils.expand_to_full_mesh_op_strategy = original
        utils.redistribute_cost = cost
        redistribute._gen_transform_infos = steps
        del propagator._propagate_tensor_meta_non_cached
        with _lock:  # what is kept holds meshes: kept for as long as some plan is being built
            _expansions.clear()
            _ids.clear()
            _costs.clear()
            _columns.clear()
            _metas.clear()
            _steps.clear()

    return undo


kept_expansions = ScopedPatch(_keep_expansions)
"""``with kept_expansions():`` DTensor's expansions are kept (see the module)."""
