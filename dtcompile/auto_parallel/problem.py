"""The placement problem: every node's candidate strategies and what each costs, with the edges between them.

Built from the traced forward (:mod:`dtcompile.auto_parallel.trace`):

- a **parameter**, **buffer** or **input** may take any even layout
  (:func:`~dtcompile.auto_parallel.placements.layouts`; buffers replicated), or
  the layout the caller fixed;
- an **op** takes DTensor's own strategies for it
  (:func:`~dtcompile.auto_parallel.strategies.op_strategies`, fed every layout
  its inputs could arrive in), each measured forward and backward
  (:func:`~dtcompile.auto_parallel.measure.measure_op`: the roofline of its
  local ops, the collectives DTensor issues in its backward, and the layouts its
  inputs' gradients come out in);
- a ``local_map`` **region** has one candidate: the placements it declares
  (:mod:`dtcompile.auto_parallel.regions`), measured like an op;
- a **constant** (a tensor made in the model from no input: a causal mask) is
  made whole on every rank, replicated;
- an **output** takes any even layout, or the fixed one; the gradient of an output
  is taken to arrive in the output's layout;
- a **fan-out** stands for a value several nodes consume, read in one layout by
  all of them: its candidates are the ``(layout, gradient layout)`` pairs they
  read it in (:mod:`~dtcompile.auto_parallel.edges`).

The **edges** between the nodes (what carrying each value to its readers costs,
forward and backward) and the fan-outs' rules are
:func:`~dtcompile.auto_parallel.edges.build_edges`'s.  The data classes, from
:class:`~dtcompile.auto_parallel.graph.Candidate` to
:class:`~dtcompile.auto_parallel.graph.Problem`, live in
:mod:`~dtcompile.auto_parallel.graph` and are importable from here too.

Every cost is in microseconds under one :class:`~dtcompile.cost.HardwareProfile`.
"""

from __future__ import annotations

import collections
import functools
import logging
import operator
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx
from torch.distributed.tensor import Partial, Replicate

from dtcompile.auto_parallel.edges import build_edges
from dtcompile.auto_parallel.expansion import kept_expansions
from dtcompile.auto_parallel.graph import Candidate, Edge, FanoutRule, PNode, Problem
from dtcompile.auto_parallel.local_ops import BORROWED, REPLICATED, borrowed_strategies, replicated_strategy, run_local
from dtcompile.auto_parallel.measure import RanInstead, _TensorSlot, flattenings, measure_op
from dtcompile.auto_parallel.placements import (
    Layout,
    layouts,
    local_numel,
    output_grad_layout,
    unstrided,
)
from dtcompile.auto_parallel.regions import region_of
from dtcompile.auto_parallel.store import Table
from dtcompile.auto_parallel.strategies import UnsupportedOp, op_strategies
from dtcompile.auto_parallel.trace import TracedModel, source_line
from dtcompile.base.op_facts import GRADIENT_PASSTHROUGH
from dtcompile.base.progress import track
from dtcompile.cost import HardwareProfile
from dtcompile.cost.simulate import node_time_us

__all__ = ["Candidate", "Edge", "FanoutRule", "PNode", "Problem", "build_problem"]

log = logging.getLogger(__name__)


_Tables = tuple[Table, Table, Table, Table]
_MEASURE_TABLES: collections.OrderedDict[Any, _Tables] = collections.OrderedDict()


def _measure_tables(mesh: Any, profile: HardwareProfile) -> _Tables:
    """The measurements made on meshes like ``mesh`` under ``profile`` (the 8 latest such keys
    kept in this process, and on disk across processes: :mod:`~dtcompile.auto_parallel.store`):
    the measured candidates, why measurements failed, the priced transfers
    (:func:`~dtcompile.auto_parallel.transfer.transfer`'s cache) and the strategies DTensor
    lists for an op given its inputs' possible layouts.

    A measurement depends on the op, its arguments, shapes and layouts (its key in the
    table) and on the mesh's device, shape, axis names, ranks and flattenings (the
    collectives' axes and spans) and the profile: the table's key; a transfer on the
    value's shape, dtype and layouts, and the same."""
    key = (mesh.device_type, tuple(mesh.shape), mesh.mesh_dim_names, tuple(mesh.mesh.flatten().tolist()),
           flattenings(mesh), profile)
    if key not in _MEASURE_TABLES:
        _MEASURE_TABLES[key] = tuple(Table(key, part) for part in ("measures", "errors", "transfers", "strategies"))
        while len(_MEASURE_TABLES) > 8:
            _MEASURE_TABLES.popitem(last=False)
    _MEASURE_TABLES.move_to_end(key)
    return _MEASURE_TABLES[key]


def _tensor_meta(value: Any) -> tuple[tuple[int, ...], torch.dtype] | None:
    if isinstance(value, torch.Tensor):
        return tuple(int(s) for s in value.shape), value.dtype
    return None


def _out_metas(node: fx.Node) -> list[tuple[tuple[int, ...], torch.dtype] | None]:
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        return [_tensor_meta(v) for v in val]
    return [_tensor_meta(val)]


def _op_text(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._opname}"
    return getattr(target, "__name__", str(target))


def _resolve(node: fx.Node) -> tuple[fx.Node, int]:
    """The value an argument reads: ``getitem(x, k)`` reads output ``k`` of ``x``."""
    if node.op == "call_function" and node.target is operator.getitem:
        return node.args[0], node.args[1]
    return node, 0


class _Builder:
    def __init__(self, traced: TracedModel, mesh: Any, profile: HardwareProfile, fixed: Mapping[str, Layout],
                 bucket_cap_bytes: int | None, regathered: frozenset[str] = frozenset()) -> None:
        self.traced, self.mesh, self.profile, self.fixed = traced, mesh, profile, fixed
        self.bucket_cap_bytes = bucket_cap_bytes
        self.regathered = regathered
        self.param_derived: dict[str, bool] = {}
        self.node_cache: dict[Any, list[Candidate]] = {}
        self.produced: dict[tuple[int, int], tuple[list[Candidate], list[Layout]]] = {}
        self.nodes: dict[str, PNode] = {}
        # Measurements outlive one plan: planning again (other pins, another budget, the
        # next model of a batch) measures only what it has not seen on this mesh.
        self.measures, self.errors, self.transfers, self.strategies = _measure_tables(mesh, profile)
        """Measured candidates (``None``: DTensor cannot run it); why a measurement failed,
        for the error when nothing can run an op."""
        self.seconds = {"strategies": 0.0, "measure": 0.0, "edges": 0.0}
        self.measurements = {"made": 0, "reused": 0}

    def _produced(self, name: str, k: int) -> list[Layout]:
        """The layouts ``name``'s candidates give its output ``k``, a stored ``_StridedShard`` read
        gathered over its axis (ops see Shard, Replicate, Partial): found once per candidate
        list (repeated layers share theirs; kept with it, so its ``id`` stays its own)."""
        candidates = self.nodes[name].candidates
        key = (id(candidates), k)
        if key not in self.produced:
            found = [unstrided(c.outputs[k]) for c in candidates if c.outputs[k] is not None]
            self.produced[key] = (candidates, list(dict.fromkeys(found)))
        return self.produced[key][1]

    def _layouts_for(self, name: str, shape: tuple[int, ...], kind: str) -> list[Layout]:
        if name in self.fixed:
            return [tuple(self.fixed[name])]
        # A parameter may also be stored FSDP2-over-TP (``_StridedShard``), gathered before use.
        return layouts(shape, self.mesh.shape, strided=kind == "param")

    def placeholders(self) -> None:
        t = self.traced
        kinds = [(n, node, "param") for n, node in t.params] + [(n, node, "buffer") for n, node in t.buffers]
        kinds += [(f"input{i}", node, "input") for i, node in enumerate(t.inputs)]
        # Parameters of one shape (the same one in each repeated layer) share one candidate list,
        # as the ops do: their edges are priced once (:func:`~dtcompile.auto_parallel.edges.build_edges`).
        shared: dict[Any, list[Candidate]] = {}
        for label, node, kind in kinds:
            meta = _tensor_meta(node.meta.get("val"))
            if meta is None:
                raise ValueError(f"auto_parallel: {label} is not a tensor; only tensor inputs are supported")
            shape = meta[0]
            options = [tuple([Replicate()] * self.mesh.ndim)] if kind == "buffer" else self._layouts_for(label, shape, kind)
            if not options:
                raise ValueError(f"auto_parallel: no layout of {label} (shape {list(shape)}) shards evenly over mesh {tuple(self.mesh.shape)}")
            rg = t.requires_grad[node.name]
            self.param_derived[node.name] = kind == "param"
            key = (tuple(options), rg)
            if key not in shared:
                shared[key] = [Candidate((), (layout,), grad_out=(layout if rg else None,)) for layout in options]
            self.nodes[node.name] = PNode(
                node.name, kind, [], [meta], [rg], shared[key], target=label, fx_node=node, group=node.name,
            )

    def tensor_constant(self, node: fx.Node) -> None:
        """A tensor the trace lifted from the model's ``forward`` (an empty tensor or a mask
        built there, a Python scalar made a tensor): the same value on every rank, replicated,
        with no gradient and nothing to decide."""
        value = getattr(self.traced.gm, node.target)
        if not isinstance(value, torch.Tensor):
            raise ValueError(
                f"auto_parallel: node {node.name} reads {node.target} (a {type(value).__name__}{source_line(node)}); "
                "only tensors, parameters and buffers are supported"
            )
        rep = tuple([Replicate()] * self.mesh.ndim)
        self.nodes[node.name] = PNode(
            node.name, "constant", [], [(tuple(value.shape), value.dtype)], [False], [Candidate((), (rep,))],
            target=f"constant {tuple(value.shape)}", fx_node=node, group=node.name,
        )

    def is_constant(self, node: fx.Node) -> bool:
        ins = [_resolve(a)[0] for a in node.all_input_nodes]
        return all(self.nodes[a.name].kind == "constant" for a in ins if a.name in self.nodes)

    def call(self, node: fx.Node) -> None:
        metas = _out_metas(node)
        if all(m is None for m in metas):
            raise ValueError(f"auto_parallel: node {node.name} ({node.target}{source_line(node)}) makes no tensor; not supported")
        index = region_of(node)
        if index is not None:  # hops' region op: (body, spec, *operands)
            self.region(node, index, [_ref(a) for a in node.args[2:]], metas)
            return
        tensor_args = [a for a in pytree.tree_leaves((node.args, node.kwargs)) if isinstance(a, fx.Node)]
        if self.is_constant(node):
            time_us = node_time_us(node, self.profile)
            rep = tuple([Replicate()] * self.mesh.ndim)
            self.nodes[node.name] = PNode(
                node.name, "constant", [_ref(a) for a in tensor_args], metas, [False] * len(metas),
                [Candidate((rep,) * len(tensor_args), tuple(rep if m else None for m in metas), forward_us=time_us)],
                target=_op_text(node.target), fx_node=node, group=node.name,
            )
            return
        refs = [_ref(a) for a in tensor_args]
        slots = iter(range(len(tensor_args)))
        args, kwargs = pytree.tree_map_only(fx.Node, lambda _: _TensorSlot(next(slots)), (node.args, node.kwargs))
        in_metas = [self.nodes[p].outputs[k] for p, k in refs]
        in_rg = [self.nodes[p].requires_grad[k] for p, k in refs]
        options, produced_by = [], []
        for p, k in refs:
            produced = self._produced(p, k)
            produced_by.append(produced)
            # What the producer can give, and the replicated layout: strategies that follow
            # their input (views, reductions) are offered for these; a strategy that reads
            # another layout gets it by a redistribution on the edge.
            replicated = tuple([Replicate()] * self.mesh.ndim)
            options.append(produced + ([replicated] if replicated not in produced else []))
        # A view of parameters alone (a transposed weight) may take its gradient Partial.
        weight_only = all(self.param_derived.get(p, False) for p, _ in refs)
        self.param_derived[node.name] = weight_only
        out_rg = [bool(m is not None and m[1].is_floating_point and any(in_rg)) for m in metas]
        # Repeated layers ask the same question again: answer it once.
        key = (node.target, repr((args, kwargs)), tuple(in_metas), tuple(in_rg), tuple(map(tuple, options)),
               tuple(map(len, produced_by)), weight_only)
        if key not in self.node_cache:
            self.node_cache[key] = self._candidates(node, args, kwargs, in_metas, in_rg, metas, out_rg, options,
                                                    produced_by, weight_only)
        candidates = self.node_cache[key]
        # An output autograd does not differentiate (a norm's saved statistics) has no gradient.
        out_rg = [rg and any(c.grad_out[i] is not None for c in candidates) for i, rg in enumerate(out_rg)]
        self.nodes[node.name] = PNode(
            node.name, "op", refs, metas, out_rg, candidates, target=_op_text(node.target), fx_node=node, group=node.name
        )

    def _candidates(self, node: fx.Node, args: Any, kwargs: Any, in_metas: list[Any], in_rg: list[bool],
                    metas: list[Any], out_rg: list[bool], options: list[list[Layout]],
                    produced_by: list[list[Layout]], weight_only: bool) -> list[Candidate]:
        """DTensor's strategies for ``node``, each measured (see the module docstring); for an op
        DTensor has none for, a twin's strategies run on local shards; where none of those can
        run, the replicated fallback (:mod:`dtcompile.auto_parallel.local_ops`)."""
        start = time.perf_counter()
        out_shapes = [m[0] if m else None for m in metas]
        asked = (node.target, repr((args, kwargs)), tuple(in_metas), tuple(map(tuple, options)), tuple(out_shapes))
        if asked not in self.strategies:
            try:
                self.strategies[asked] = ("", op_strategies(node.target, args, kwargs, in_metas, options, out_shapes, self.mesh))
            except UnsupportedOp:
                self.strategies[asked] = (BORROWED, borrowed_strategies(
                    node.target, args, kwargs, in_metas, options, out_shapes, self.mesh))
        local, strategies = self.strategies[asked]
        self.seconds["strategies"] += time.perf_counter() - start
        # A Partial input only comes from a producer that makes it (redistribute cannot); the
        # strategy's variant that is handed it replicated stays (see strategies.py).
        strategies = [
            (ins, outs) for ins, outs in strategies
            if all(not isinstance(p, Partial) or layout in options[i][: len(produced_by[i])]
                   for i, layout in enumerate(ins) for p in layout)
        ]
        start = time.perf_counter()
        signature = (node.target, repr((args, kwargs)), tuple(in_metas), tuple(in_rg))
        candidates = self._measured(node, signature, args, kwargs, in_metas, in_rg, metas, out_rg, strategies,
                                    weight_only, local)
        if not candidates:
            fallback = replicated_strategy(len(in_metas), metas, self.mesh)
            candidates = self._measured(node, signature, args, kwargs, in_metas, in_rg, metas, out_rg, [fallback],
                                        False, REPLICATED)
        self.seconds["measure"] += time.perf_counter() - start
        if not candidates:
            error = self.errors.get((signature, *fallback, REPLICATED), "")
            raise ValueError(
                f"auto_parallel: node {node.name} ({_op_text(node.target)}{source_line(node)}) cannot be planned: no DTensor strategy "
                f"runs it on mesh {tuple(self.mesh.shape)}, and run whole on every rank it fails ({error}); "
                "pin the parameters and inputs around it with fixed=..., or wrap the code that calls it in "
                "dtcompile.local_map with the placements it needs"
            )
        return candidates

    def _measured(self, node: fx.Node, signature: Any, args: Any, kwargs: Any, in_metas: list[Any],
                  in_rg: list[bool], metas: list[Any], out_rg: list[bool], strategies: list[Any],
                  weight_only: bool, local: str) -> list[Candidate]:
        """The strategies DTensor (or, ``local`` set, :func:`run_local`) runs as chosen, measured."""
        candidates = []
        # What DTensor ran when handed these input layouts for another strategy: a strategy with
        # the same inputs and other outputs is not what it runs (its decision depends on the op,
        # its arguments and the inputs' layouts only), and is not run again to learn that.
        ran: dict[Layout, RanInstead] = {}
        for ins, outs in strategies:
            target = functools.partial(run_local, node.target, outs) if local else node.target
            for grad_out in _grad_variants(node.target, outs, out_rg, weight_only and not local):
                key = (signature, ins, outs, grad_out, local)
                measured = key in self.measures
                self.measurements["reused" if measured else "made"] += 1
                if not measured and ins in ran and not ran[ins].runs(outs):
                    self.measures[key] = None
                elif not measured:
                    try:
                        # RanInstead: DTensor, handed ``ins``, runs another strategy (other outputs,
                        # or a collective before the op).
                        m = measure_op(
                            target, args, kwargs, [(s, d, rg) for (s, d), rg in zip(in_metas, in_rg)], ins, metas,
                            grad_out, self.mesh, self.profile, self.traced.fake_mode, expected_outs=outs,
                        )
                    except Exception as e:  # DTensor cannot run it (forward or backward): not a candidate
                        log.debug("auto_parallel: %s %s -> %s dropped: %s", node.name, ins, outs, e)
                        self.measures[key] = None
                        self.errors[(signature, ins, outs, local)] = f"{type(e).__name__}: {e}"
                        continue
                    if isinstance(m, RanInstead):
                        ran[ins] = m
                        self.measures[key] = None
                        continue
                    ran[ins] = RanInstead(m.out_layouts, False)  # what it runs for these inputs
                    # An output autograd does not differentiate takes no gradient.
                    grads_back = tuple(g if rg else None for g, rg in zip(grad_out, m.out_requires_grad))
                    self.measures[key] = Candidate(
                        ins, outs, m.grad_layouts, grads_back, m.forward_us, m.backward_us, m.collectives,
                        sum(c.time_us(self.profile) for c in m.collectives), local, m.saved,
                        m.saved_outputs, m.saved_bytes,
                    )
                if self.measures[key] is not None:
                    candidates.append(self.measures[key])
        return list(dict.fromkeys(candidates))

    def region(self, node: fx.Node, index: int, refs: list[tuple[str, int]], metas: list[Any]) -> None:
        """A ``local_map`` region: its one candidate, its declared placements, measured."""
        region = self.traced.regions[index]
        in_metas = [self.nodes[p].outputs[k] for p, k in refs]
        in_rg = [self.nodes[p].requires_grad[k] for p, k in refs]
        out_rg = [bool(m is not None and m[1].is_floating_point and any(in_rg)) for m in metas]
        if len(region.in_placements) != len(refs) or len(region.out_placements) != len(metas):
            raise ValueError(
                f"auto_parallel: local_map region {region.name} declares {len(region.in_placements)} inputs and "
                f"{len(region.out_placements)} outputs but is called with {len(refs)} and returns {len(metas)}"
            )
        grad_out = tuple(output_grad_layout(o) if rg else None for o, rg in zip(region.out_placements, out_rg))
        m = measure_op(
            region.fn, tuple(_TensorSlot(i) for i in range(len(refs))), {},
            [(s, d, rg) for (s, d), rg in zip(in_metas, in_rg)], region.in_placements, metas, grad_out,
            self.mesh, self.profile, self.traced.fake_mode,
        )
        candidate = Candidate(
            region.in_placements, region.out_placements, m.grad_layouts, grad_out, m.forward_us, m.backward_us,
            m.collectives, sum(c.time_us(self.profile) for c in m.collectives),
            saved_outputs=m.saved_outputs, saved_bytes=m.saved_bytes,
        )
        self.nodes[node.name] = PNode(
            node.name, "region", refs, metas, out_rg, [candidate], target=f"local_map[{region.name}]",
            fx_node=node, group=node.name,
        )

    def outputs(self, output_layouts: Mapping[int, Layout]) -> None:
        (out_args,) = [n for n in self.traced.gm.graph.nodes if n.op == "output"][0].args
        for i, arg in enumerate(out_args):
            if not isinstance(arg, fx.Node):
                raise ValueError(f"auto_parallel: output {i} is not a tensor; only tensor outputs are supported")
            p, k = _ref(arg)
            meta = self.nodes[p].outputs[k]
            options = [tuple(output_layouts[i])] if i in output_layouts else layouts(meta[0], self.mesh.shape)
            rg = self.nodes[p].requires_grad[k]
            name = f"output{i}"
            self.nodes[name] = PNode(
                name, "output", [(p, k)], [meta], [False],
                [Candidate((layout,), (layout,), (layout if rg else None,)) for layout in options],
                target="output", group=name,
            )


# A view's backward only moves the gradient (a view of it): a ``Partial`` gradient
# passes through it unchanged, so a replicated output may take its gradient partial
# (the transposed weight of a data-parallel matmul: its gradient reduces at the weight).
# The views: :data:`~dtcompile.base.op_facts.GRADIENT_PASSTHROUGH`.
def _grad_variants(
    target: Any, outs: tuple[Layout | None, ...], out_rg: list[bool], of_weights: bool
) -> list[tuple[Layout | None, ...]]:
    """The layouts the outputs' gradients may arrive in: replicated where an output is
    ``Partial`` (``redistribute``'s backward), else the output's own layout; for a view
    of parameters alone, also ``Partial`` on any subset of its replicated axes."""
    base = tuple(output_grad_layout(o) if o is not None and rg else None for o, rg in zip(outs, out_rg))
    name = getattr(target, "_opname", "")
    if not of_weights or name not in GRADIENT_PASSTHROUGH or len(outs) != 1 or base[0] is None:
        return [base]
    layout = base[0]
    replicated = [axis for axis, p in enumerate(layout) if isinstance(p, Replicate) and not isinstance(outs[0][axis], Partial)]
    variants = [base]
    for mask in range(1, 1 << len(replicated)):
        g = list(layout)
        for bit, axis in enumerate(replicated):
            if mask >> bit & 1:
                g[axis] = Partial()
        variants.append((tuple(g),))
    return variants


def _ref(arg: fx.Node) -> tuple[str, int]:
    node, index = _resolve(arg)
    return node.name, index


def _refuse_writes(node: fx.Node, traced: TracedModel) -> None:
    """An op that writes in place to a parameter, buffer or input (or a view of one: a norm's
    running statistics in training, ``x.relu_()`` on the input) is refused: the parallel model
    hands each op its own ``redistribute``d copy of such a value, so the write would land in the
    copy and be lost -- a silent wrong result.  A write to a value computed in the model is
    kept: the traced graph reads the written value from the in-place op's result."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.is_mutable:
        return
    names = {n.name: name for name, n in traced.params + traced.buffers}
    names.update({n.name: f"input{i}" for i, n in enumerate(traced.inputs)})

    def origin(arg: fx.Node) -> fx.Node:
        while arg.op == "call_function" and getattr(arg.target, "_opname", "") in GRADIENT_PASSTHROUGH and arg.args:
            arg = arg.args[0]
        return arg

    written = [
        names[origin(arg).name]
        for arg, spec in zip(node.args, schema.arguments)
        if isinstance(arg, fx.Node) and spec.alias_info is not None and spec.alias_info.is_write
        and origin(arg).name in names
    ]
    if written:
        raise ValueError(
            f"auto_parallel: node {node.name} ({_op_text(node.target)}{source_line(node)}) writes to {', '.join(written)} in place, "
            "which the parallel model cannot carry back (it reads each parameter, buffer and input through its "
            "own redistributed copy); put modules that update running statistics in eval() mode before "
            "planning, or write the model's update out of place"
        )


def build_problem(
    traced: TracedModel,
    mesh: Any,
    profile: HardwareProfile,
    *,
    fixed: Mapping[str, Layout] | None = None,
    output_layouts: Mapping[int, Layout] | None = None,
    bucket_cap_bytes: int | None = 256 * 1024 * 1024,
    resharded: Callable[[str], bool] = lambda name: True,
) -> Problem:
    """The problem for ``traced`` on ``mesh``; ``fixed`` pins parameters (by name) or
    inputs (``input0``...) to one layout, ``output_layouts`` pins outputs by position;
    ``bucket_cap_bytes``: the compile config's (``None``: its ``bucketing`` pass is off);
    ``resharded``: whether the compile config gathers a parameter (by name) again in the backward."""
    regathered = frozenset(node.name for name, node in traced.params if resharded(name))
    b = _Builder(traced, mesh, profile, dict(fixed or {}), bucket_cap_bytes, regathered)
    b.placeholders()
    nodes = traced.gm.graph.nodes
    with kept_expansions():
        for node in track(nodes, "auto_parallel: candidate placements", len(nodes), unit="node"):
            if node.op == "call_function" and node.target is not operator.getitem:
                _refuse_writes(node, traced)
                b.call(node)
            elif node.op == "get_attr" and not isinstance(getattr(traced.gm, node.target), fx.GraphModule):
                b.tensor_constant(node)
    b.outputs(dict(output_layouts or {}))
    start = time.perf_counter()
    edges, fanout_rules = build_edges(b.nodes, mesh, profile, bucket_cap_bytes, regathered, b.transfers)
    b.seconds["edges"] = time.perf_counter() - start
    for table in (b.measures, b.errors, b.transfers, b.strategies):
        table.save()
    param_bytes = {}
    for _, node in traced.params:
        pnode = b.nodes[node.name]
        shape, dtype = pnode.outputs[0]
        param_bytes[node.name] = [local_numel(shape, c.outputs[0], mesh.shape) * dtype.itemsize for c in pnode.candidates]
    return Problem(mesh, profile, b.nodes, edges, fanout_rules, traced, param_bytes, bucket_cap_bytes, b.seconds,
                   b.measurements, regathered)
