"""What a choice costs: an op run by DTensor on fake shards, and a redistribution as DTensor plans it.

Two measurements feed the solver, both in dtcompile's own terms so that the
solution's estimate is the estimate of the graphs dtcompile will compile:

- :func:`measure_op`: one op, with its inputs in the layouts of one candidate
  strategy, is run by DTensor on fake local shards *with its backward* (the
  gradient of each output arriving in a given layout), traced with
  ``make_fx`` down to the local aten ops and functional collectives DTensor
  issues.  Each traced node is timed by :func:`dtcompile.cost.simulate.node_time_us`
  (the roofline) and each collective read by
  :func:`dtcompile.graph.collectives.collective_info` and timed by the cost model;
  the layouts DTensor gives the inputs' gradients are read back.  The backward
  is measured rather than chosen because the applied model is an ordinary DTensor
  module: autograd runs each op's backward with DTensor's own propagation, so
  the forward choice decides it.
- :func:`plan_redistribution`: the collectives of one ``redistribute`` from
  DTensor's own planner (``_gen_transform_infos``), without tracing (the solver
  needs thousands); :func:`trace_redistribution` traces the same thing, and the
  tests check that the two agree.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from dtcompile.auto_parallel.placements import Layout, PlannedCollective, axis_span, is_shard, is_strided, local_numel
from dtcompile.base.channels import GraphKind
from dtcompile.cost import HardwareProfile
from dtcompile.cost.simulate import node_time_us
from dtcompile.graph.collectives import collective_info, flattened_axes

__all__ = [
    "OpMeasure",
    "RanInstead",
    "flattenings",
    "measure_op",
    "plan_redistribution",
    "planned_redistribution",
    "redistribution_copy_bytes",
    "trace_redistribution",
]


@dataclass(frozen=True)
class OpMeasure:
    """One op under one strategy, forward and backward, as DTensor runs it."""

    forward_us: float
    """Roofline time of the forward's local ops."""
    backward_us: float
    """Roofline time of the backward's local ops."""
    collectives: tuple[PlannedCollective, ...]
    """Collectives DTensor issues inside the op (its backward's redistributions)."""
    out_layouts: tuple[Layout | None, ...]
    """The layout DTensor gave each output (compared with the strategy's)."""
    grad_layouts: tuple[Layout | None, ...]
    """Per tensor input: the layout of its gradient, ``None`` when it gets none."""
    out_requires_grad: tuple[bool, ...] = ()
    """Per output: whether autograd differentiates it (``native_layer_norm``'s mean and rstd: no)."""
    saved: tuple[bool, ...] = ()
    """Per tensor input: whether the backward reads it (or what the forward made of it
    alone, ``t(w)``): saved for the backward, so a gathered parameter is gathered
    again there where dtcompile reshards after forward (:mod:`dtcompile.pipeline.reshard`)."""
    saved_outputs: tuple[bool, ...] = ()
    """Per output: whether the op's own backward reads it (``relu``'s, SDPA's)."""
    saved_bytes: int = 0
    """Bytes per rank of what the op's backward reads that the op made, outputs included
    (SDPA's output and log-sum-exp, a norm's statistics): kept from the forward to the
    backward (:mod:`~dtcompile.auto_parallel.peak`)."""


@dataclass(frozen=True)
class RanInstead:
    """Handed a strategy's input layouts, DTensor ran another strategy (see :func:`measure_op`)."""

    out_layouts: tuple[Layout | None, ...]
    """The layouts DTensor gave the outputs."""
    communicated: bool
    """Whether it redistributed an input first (a collective before the op)."""

    def runs(self, outs: Sequence[Layout | None]) -> bool:
        """Whether a strategy with these input layouts and output layouts ``outs`` is what DTensor runs."""
        return not self.communicated and _same_outputs(self.out_layouts, outs)


def _same_outputs(got: Sequence[Any], expected: Sequence[Layout | None]) -> bool:
    return all(e is None or tuple(o or ()) == tuple(e) for o, e in zip(got, expected))


# Fused norm backwards take the weight (and bias) whatever they compute; decomposed, as
# the compiled graphs are, the weight is read only for the input's gradient:
# op -> (its output_mask's argument, the weight's and bias's arguments).
_NORM_BACKWARDS = {
    "native_layer_norm_backward": (7, (5, 6)),
    "native_group_norm_backward": (9, (4,)),
    "_fused_rms_norm_backward": (5, (4,)),
    "native_batch_norm_backward": (9, (2,)),
}


def _args_read(node: fx.Node) -> list[fx.Node]:
    """The nodes a recorded backward node reads, as its decomposition would."""
    name = getattr(node.target, "__name__", "").split(".")[0]
    if name not in _NORM_BACKWARDS:
        return node.all_input_nodes
    mask_at, weights = _NORM_BACKWARDS[name]
    mask = node.args[mask_at] if len(node.args) > mask_at else None
    if mask is None or mask[0]:
        return [a for i, a in enumerate(node.args) if isinstance(a, fx.Node) and i not in weights[1:]]
    return [a for i, a in enumerate(node.args) if isinstance(a, fx.Node) and i not in weights]


def _read_by_backward(graph: fx.Graph, boundary: int, num_inputs: int,
                      outputs: Sequence[fx.Node | None]) -> tuple[tuple[bool, ...], tuple[bool, ...], int]:
    """What the backward of a recorded op reads (a fused norm backward's weight only where it
    computes the input's gradient: :data:`_NORM_BACKWARDS`): per input placeholder, whether
    a node past ``boundary`` reads it or a forward node computed from it alone; per output
    node, whether one reads it; and the bytes of the forward's nodes it reads that are made
    from more than one input alone (the outputs among them)."""
    nodes = list(graph.nodes)
    read_by = {n for node in nodes[boundary:] for n in _args_read(node)}
    read, derived_any = [], set()
    for i in range(num_inputs):
        derived = {nodes[i]}
        for node in nodes[num_inputs:boundary]:
            inputs = node.all_input_nodes
            if inputs and all(n in derived for n in inputs):
                derived.add(node)
        read.append(bool(derived & read_by))
        derived_any |= derived
    # (The outputs' gradients are placeholders too, made before the forward ran.)
    made = [n for n in nodes[num_inputs:boundary] if n.op != "placeholder" and n in read_by and n not in derived_any]
    own = sum(_nbytes(n.meta.get("val")) for n in made)
    return tuple(read), tuple(n is not None and n in read_by for n in outputs), own


def _nbytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor))


def _axis_names(mesh: Any) -> dict[str, str]:
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    return {**flattened_axes(mesh), **{mesh.get_group(axis).group_name: name for axis, name in enumerate(names)}}


def _read_graph(graph: fx.Graph, boundary: int, mesh: Any, profile: HardwareProfile) -> tuple[float, float, list[PlannedCollective]]:
    axes = _axis_names(mesh)
    forward = backward = 0.0
    found = []
    for index, node in enumerate(graph.nodes):
        direction = GraphKind.FORWARD if index < boundary else GraphKind.BACKWARD
        info = collective_info(node, axes)
        if info is not None:
            found.append(PlannedCollective(direction, info.op, info.axis, info.group_size, info.bytes, info.group_span))
            continue
        cost = node_time_us(node, profile)
        if direction == GraphKind.FORWARD:
            forward += cost
        else:
            backward += cost
    return forward, backward, found


@functools.cache
def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))


def _global_stride(shape: Sequence[int]) -> tuple[int, ...]:
    """A contiguous tensor's strides (as ``torch.empty(shape).stride()``)."""
    return _contiguous_stride(tuple(shape))


def _local_shape(shape: Sequence[int], layout: Layout, mesh_shape: Sequence[int]) -> tuple[int, ...]:
    local = list(shape)
    for placement, size in zip(layout, mesh_shape):
        if is_shard(placement):
            local[placement.dim] //= size
    return tuple(local)


def _meta_local(shape: Sequence[int], dtype: torch.dtype, layout: Layout, mesh: Any, requires_grad: bool) -> torch.Tensor:
    """A local shard of that layout on the ``meta`` device (see :func:`measure_op`)."""
    return torch.empty(_local_shape(shape, layout, mesh.shape), dtype=dtype, device="meta", requires_grad=requires_grad)


def _fake_local(fake_mode: Any, shape: Sequence[int], dtype: torch.dtype, layout: Layout, mesh: Any, requires_grad: bool) -> torch.Tensor:
    with fake_mode:
        return torch.empty(_local_shape(shape, layout, mesh.shape), dtype=dtype, device=mesh.device_type, requires_grad=requires_grad)


@contextlib.contextmanager
def _releasing_masks(outs: list[Any]) -> Iterator[None]:
    """Releases, on the way out, the index masks the ``outs`` hold.

    A row-sharded embedding's partial output (DTensor's ``_MaskPartial``) keeps the mask of
    the indices it came from in the placement object until the value is reduced, and
    DTensor's sharding cache hands that same object to the next identical op.  A measurement
    never reduces its outputs: its fake mask would stay there, and the user's next real
    embedding would fail (``Mixing fake modes``) or use it."""
    try:
        yield
    finally:
        for out in outs:
            for placement in getattr(out, "placements", ()):
                buffer = getattr(placement, "mask_buffer", None)
                if buffer is not None and buffer.refcount:
                    buffer.data, buffer.refcount = None, 0


def measure_op(
    target: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    tensors: Sequence[tuple[tuple[int, ...], torch.dtype, bool]],
    in_layouts: Sequence[Layout],
    out_metas: Sequence[tuple[tuple[int, ...], torch.dtype] | None],
    grad_layouts: Sequence[Layout | None],
    mesh: Any,
    profile: HardwareProfile,
    fake_mode: Any,
    expected_outs: Sequence[Layout | None] | None = None,
) -> OpMeasure | RanInstead:
    """Trace ``target`` on DTensors of layouts ``in_layouts`` and its backward.

    ``args``/``kwargs`` hold :class:`_TensorSlot` markers where tensors go;
    ``tensors[i]`` is ``(global shape, dtype, requires_grad)`` of the i-th;
    ``out_metas`` are the outputs' global ``(shape, dtype)``, and
    ``grad_layouts`` the layouts their gradients arrive in (``None``: no gradient).
    With ``expected_outs`` (the strategy's output layouts), a :class:`RanInstead` when
    DTensor's forward runs another strategy (other output layouts, or a collective before
    the op), found before the backward is traced: such a strategy is not a candidate, and
    neither is any other with these input layouts but the one DTensor ran.

    An aten op (run by DTensor, or on local shards by a ``functools.partial`` applying it, as
    :func:`~dtcompile.auto_parallel.local_ops.run_local` is)
    runs on shards on the ``meta`` device (its meta kernel, without a fake
    mode's dispatch: a fifth of a measurement); where that fails (an op without a meta
    kernel) and anything else (a ``local_map`` region, which may read its values), on
    fake shards of ``fake_mode`` on the mesh's device.  What DTensor decides and the ops it
    issues are the same on both; the local ops' shapes are all the roofline reads.
    """
    def measured(make_local: Any) -> OpMeasure | RanInstead:
        num_in = len(tensors)
        differentiable = [
            i for i, (meta, layout) in enumerate(zip(out_metas, grad_layouts))
            if meta is not None and layout is not None and meta[1].is_floating_point
        ]
        wants_grad = any(rg for _, _, rg in tensors)
        grad_outs = []
        if wants_grad:
            for i in differentiable:
                shape, dtype = out_metas[i]
                grad_outs.append((shape, dtype, grad_layouts[i]))
        # An op that writes in place needs its inputs made by an autograd function (not leaves).
        leaves = isinstance(target, torch._ops.OpOverload) and not target._schema.is_mutable
        flat = [make_local(shape, dtype, layout, mesh, rg and not leaves) for (shape, dtype, rg), layout in zip(tensors, in_layouts)]
        grads_local = [make_local(shape, dtype, layout, mesh, False) for shape, dtype, layout in grad_outs]
        recorder = _Recorder()
        recorder.known(flat + grads_local)
        outs: list[Any] = []
        with recorder, _releasing_masks(outs):
            dts = [
                _dtensor(local, mesh, layout, shape, rg, leaves) for (shape, _, rg), layout, local in zip(tensors, in_layouts, flat)
            ]
            call_args, call_kwargs = pytree.tree_map_only(_TensorSlot, lambda slot: dts[slot.index], (args, kwargs))
            out = target(*call_args, **call_kwargs)
            outs += list(out) if isinstance(out, (tuple, list)) else [out]
            out_layouts = tuple(o.placements if isinstance(o, DTensor) else None for o in outs)
            out_rg = tuple(isinstance(o, torch.Tensor) and o.requires_grad for o in outs)
            boundary = len(recorder.graph.nodes)
            if expected_outs is not None:
                ran = RanInstead(out_layouts, _communicated(recorder.graph, mesh))
                if not ran.runs(expected_outs):
                    return ran
            grad_layouts_in: tuple[Layout | None, ...] = (None,) * num_in
            # Only outputs autograd differentiates take a gradient (not an op's saved statistics).
            kept = [j for j, i in enumerate(differentiable) if out_rg[i]] if grad_outs else []
            if kept:
                diff = [outs[differentiable[j]] for j in kept]
                grads = [
                    _dtensor(g, mesh, layout, shape, False, leaves)
                    for j, ((shape, _, layout), g) in enumerate(zip(grad_outs, grads_local)) if j in kept
                ]
                wrt = [dt for dt, (_, _, rg) in zip(dts, tensors) if rg]
                got = iter(torch.autograd.grad(diff, wrt, grads, allow_unused=True))
                grad_layouts_in = tuple(
                    (lambda g: tuple(g.placements) if isinstance(g, DTensor) else None)(next(got)) if rg else None
                    for _, _, rg in tensors
                )
        forward, backward, found = _read_graph(recorder.graph, boundary, mesh, profile)
        out_nodes = [recorder.node_of(o._local_tensor) if isinstance(o, DTensor) else None for o in outs]
        saved, saved_outs, own = _read_by_backward(recorder.graph, boundary, num_in, out_nodes)
        return OpMeasure(forward, backward, tuple(found), out_layouts, grad_layouts_in, out_rg, saved, saved_outs, own)

    # (An op run on local shards is a partial applying the aten op: run_local's.)
    op = target.args[0] if isinstance(target, functools.partial) and target.args else target
    if isinstance(op, torch._ops.OpOverload):
        try:
            return measured(_meta_local)
        except Exception:
            pass
    return measured(functools.partial(_fake_local, fake_mode))


def _dtensor(local: torch.Tensor, mesh: Any, layout: Layout, shape: Sequence[int], requires_grad: bool,
             leaf: bool) -> DTensor:
    """A DTensor of global ``shape`` (contiguous) laid out as ``layout`` over ``local``.

    ``leaf``: made as DTensor's ops make their results, a leaf (``requires_grad``), not
    through ``from_local``'s autograd function, which took a fifth of a measurement (the
    same graphs are recorded).  Not for an op that writes in place (autograd refuses that
    on a leaf), nor a ``local_map`` region or an op run on local shards: those take
    ``from_local``'s, over a ``local`` that requires grad itself."""
    if not leaf:
        return DTensor.from_local(local, mesh, layout, run_check=False, shape=tuple(shape), stride=_global_stride(shape))
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    meta = TensorMeta(torch.Size(shape), _global_stride(shape), local.dtype)
    return DTensor(local, DTensorSpec(mesh, tuple(layout), tensor_meta=meta), requires_grad=requires_grad)


def _communicated(graph: fx.Graph, mesh: Any) -> bool:
    """Whether the forward recorded in ``graph`` issued a collective (a redistribution of an
    input before the op: not the strategy its inputs were handed in)."""
    axes = _axis_names(mesh)
    return any(collective_info(node, axes) is not None for node in graph.nodes)


_NOT_WORK = {"empty", "empty_strided", "detach", "alias", "device", "lift_fresh", "lift_fresh_copy"}


class _Recorder:
    """Records the local aten ops and functional collectives DTensor runs, as an FX graph.

    A ``TorchDispatchMode`` that steps aside for DTensor's own dispatch (so it sees what
    DTensor issues on the local shards) and runs everything else as it is: the shards are
    fake tensors, so nothing is computed and no collective moves data.  Unlike tracing
    with ``make_fx``, DTensor does not think it is being traced, so it keeps using its
    cached sharding decisions: a measurement takes milliseconds.
    """

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        self.graph = fx.Graph()
        self._depth = 0
        self._nodes: dict[int, fx.Node] = {}
        self._alive: list[Any] = []  # ids stay unique while recorded tensors live
        recorder = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                kwargs = kwargs or {}
                if any(issubclass(t, DTensor) for t in types):
                    return NotImplemented
                outer = recorder._depth == 0
                recorder._depth += 1
                try:
                    out = func(*args, **kwargs)
                finally:
                    recorder._depth -= 1
                # Fake tensors run an op again inside (its meta kernel): only the outer call counts;
                # making and detaching the shells of tensors is no work a compiled graph keeps.
                if outer and getattr(func, "_opname", "") not in _NOT_WORK:
                    recorder._record(func, args, kwargs, out)
                return out

        self._mode = Mode()

    def __enter__(self) -> _Recorder:
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)

    def _node(self, t: torch.Tensor) -> fx.Node:
        if id(t) not in self._nodes:
            node = self.graph.placeholder(f"input{len(self._nodes)}")
            node.meta["val"] = t
            self._nodes[id(t)] = node
            self._alive.append(t)
        return self._nodes[id(t)]

    def node_of(self, t: torch.Tensor) -> fx.Node | None:
        """The recorded node that made ``t`` (``None``: none did)."""
        return self._nodes.get(id(t))

    def known(self, tensors: Sequence[torch.Tensor]) -> None:
        """Make ``tensors`` the program's inputs: ops on other tensors (DTensor's own
        shape propagation on fake tensors of its own) are not part of the program."""
        for t in tensors:
            self._node(t)

    def _record(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        if any(isinstance(a, torch.Tensor) and id(a) not in self._nodes for a in pytree.tree_leaves((args, kwargs))):
            return
        call_args, call_kwargs = pytree.tree_map_only(torch.Tensor, self._node, (args, kwargs))
        node = self.graph.call_function(func, tuple(call_args), dict(call_kwargs))
        node.meta["val"] = out
        for leaf in pytree.tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._nodes[id(leaf)] = node
                self._alive.append(leaf)


@dataclass(frozen=True)
class _TensorSlot:
    """Where the i-th tensor argument goes in an op's ``args``/``kwargs``."""

    index: int


def flattenings(mesh: Any) -> tuple[str, ...]:
    """The names of the flattened meshes made from ``mesh``'s root: a mesh compares equal before
    and after ``_flatten``, but what DTensor does on it (merging collectives) differs."""
    return tuple(sorted(getattr(mesh._get_root_mesh(), "_flatten_mapping", {})))


def _plan(
    shape: Sequence[int], dtype: torch.dtype, src: Layout, dst: Layout, mesh: Any, direction: str
) -> tuple[tuple[PlannedCollective, ...], int, bool]:
    """:func:`_plan_cached` keyed by the mesh's flattenings too: a mesh compares equal
    before and after ``_flatten``, but DTensor merges collectives over a flattened mesh."""
    return _plan_cached(tuple(shape), dtype, tuple(src), tuple(dst), mesh, flattenings(mesh), direction)


@functools.cache
def _plan_cached(
    shape: tuple[int, ...], dtype: torch.dtype, src: Layout, dst: Layout, mesh: Any, flattened: tuple[str, ...],
    direction: str,
) -> tuple[tuple[PlannedCollective, ...], int, bool]:
    from torch.distributed.tensor._redistribute import _FlattenedTransformInfo

    infos = _transform_steps(shape, dtype, src, dst, mesh, flattened)
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    mesh_shape = tuple(mesh.shape)
    itemsize = dtype.itemsize
    current = list(src)
    found = []
    moved = 0  # elements read and written by the local copies around the collectives
    read_at_once = False  # local work follows the last collective: its result is read at once
    for info in infos:
        before = local_numel(shape, tuple(current), mesh_shape)
        a, b = info.src_dst_placements
        if isinstance(info, _FlattenedTransformInfo):
            dims = info.original_mesh_dims
            group_mesh = info.mesh
            axis, size, span = group_mesh.mesh_dim_names[0], group_mesh.size(), axis_span(group_mesh, 0)
        else:
            dims = (info.mesh_dim,)
            axis, size, span = names[info.mesh_dim], mesh.size(info.mesh_dim), axis_span(mesh, info.mesh_dim)
        gathered = list(current)
        for d in dims:
            gathered[d] = Replicate()
            current[d] = b
        full = local_numel(shape, tuple(gathered), mesh_shape)
        after = local_numel(shape, tuple(current), mesh_shape)
        # Collectives run on dim 0: another dim is put back together (cat) after a
        # gather, laid out (cat) before a reduce-scatter; a chunk is cloned.
        read_at_once = False
        if isinstance(a, Partial) and isinstance(b, Replicate):
            op, numel = "all_reduce", before
        elif isinstance(a, Partial) and isinstance(b, Shard):
            op, numel = "reduce_scatter", before
            moved += 2 * before if b.dim != 0 else 0
        elif isinstance(a, Shard) and isinstance(b, Replicate):
            op, numel = "all_gather", full
            moved += 2 * full if a.dim != 0 else 0
            read_at_once = a.dim != 0
        elif isinstance(a, Shard) and isinstance(b, Shard):
            # shard_dim_alltoall: gloo has no all-to-all, DTensor all-gathers and chunks on CPU.
            if mesh.device_type == "cpu":
                op, numel = "all_gather", full
                moved += (2 * full if a.dim != 0 else 0) + (2 * after if b.dim != 0 else 0)
                read_at_once = True
            else:
                op, numel = "all_to_all", before
        else:
            if isinstance(a, Replicate) and isinstance(b, Shard):
                moved += 2 * after
                read_at_once = bool(found)
            continue  # a local chunk (replicate -> shard) or replicate -> partial: no communication
        found.append(PlannedCollective(direction, op, axis, size, numel * itemsize, span))
    return tuple(found), moved * itemsize, read_at_once


def _transform_steps(shape: tuple[int, ...], dtype: torch.dtype, src: Layout, dst: Layout, mesh: Any,
                     flattened: tuple[str, ...]) -> tuple[Any, ...]:
    """DTensor's steps from ``src`` to ``dst`` (``_TransformInfo``\\ s, merged over flattened meshes).

    Its greedy planner, the one it uses for placements without ``_StridedShard`` unless told
    to search (``_FORCE_MIN_COST_REDISTRIBUTION_PLAN``), takes the same steps whatever the
    shape (only each step's ``logical_shape``, unread here, differs): those are asked once per
    layouts and mesh; others once per shape (:func:`_plan_cached`)."""
    if not steps_ignore_shape((*src, *dst)):
        return _steps(shape, dtype, src, dst, mesh)
    key = (src, dst, mesh, id(mesh), flattened)  # (the mesh object: kept alive by the steps)
    with _STEPS_LOCK:
        found = _STEPS.get(key)
    if found is None:
        found = _steps(shape, dtype, src, dst, mesh)
        with _STEPS_LOCK:  # rank threads may plan at once
            _STEPS[key] = found
            while len(_STEPS) > 4096:
                del _STEPS[next(iter(_STEPS))]
    return found


_STEPS: dict[Any, tuple[Any, ...]] = {}
_STEPS_LOCK = threading.Lock()


def steps_ignore_shape(placements: Iterable[Any]) -> bool:
    """Whether DTensor plans a redistribution between layouts of these placements (in its default
    shard order) with its greedy planner, whose steps are the same whatever the shape: unless it
    is told to search (``_FORCE_MIN_COST_REDISTRIBUTION_PLAN``) or one is ``_StridedShard``."""
    import torch.distributed.tensor._redistribute as redistribute

    return not getattr(redistribute, "_FORCE_MIN_COST_REDISTRIBUTION_PLAN", None) and not any(map(is_strided, placements))


def _steps(shape: tuple[int, ...], dtype: torch.dtype, src: Layout, dst: Layout, mesh: Any) -> tuple[Any, ...]:
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._redistribute import _gen_transform_infos, _optimize_transform_infos

    meta = TensorMeta(torch.Size(shape), _global_stride(shape), dtype)
    src_spec = DTensorSpec(mesh, src, tensor_meta=meta)
    dst_spec = DTensorSpec(mesh, dst, tensor_meta=meta)
    return tuple(_optimize_transform_infos(_gen_transform_infos(src_spec, dst_spec), mesh, src, dst))


def plan_redistribution(
    shape: Sequence[int], dtype: torch.dtype, src: Layout, dst: Layout, mesh: Any, direction: GraphKind = GraphKind.FORWARD
) -> tuple[PlannedCollective, ...]:
    """The collectives of redistributing a ``shape`` tensor from ``src`` to ``dst``, as
    DTensor's planner orders them (one per mesh axis that changes, or one over a
    flattened mesh where DTensor merges them)."""
    return planned_redistribution(shape, dtype, src, dst, mesh, direction)[0]


def planned_redistribution(
    shape: Sequence[int], dtype: torch.dtype, src: Layout, dst: Layout, mesh: Any, direction: GraphKind = GraphKind.FORWARD
) -> tuple[tuple[PlannedCollective, ...], int, bool]:
    """That redistribution's collectives (:func:`plan_redistribution`), the bytes its local
    copies read and write (:func:`redistribution_copy_bytes`) and whether local work (a cat, a
    chunk) follows its last collective, so that its result is read as soon as it arrives
    (dtcompile's bucketing cannot wait for others), from one plan."""
    if tuple(src) == tuple(dst):
        return (), 0, False
    return _plan(shape, dtype, src, dst, mesh, direction)


def redistribution_copy_bytes(shape: Sequence[int], dtype: torch.dtype, src: Layout, dst: Layout, mesh: Any) -> int:
    """Bytes the local copies of that redistribution read and write (a ``cat`` putting a
    gathered dim other than 0 back together, a cloned chunk), for the roofline."""
    return planned_redistribution(shape, dtype, src, dst, mesh)[1]


def trace_redistribution(
    shape: Sequence[int], dtype: torch.dtype, src: Layout, dst: Layout, mesh: Any, profile: HardwareProfile
) -> tuple[PlannedCollective, ...]:
    """The collectives ``redistribute(src -> dst)`` issues, traced on fake shards (for tests)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    def run(local: torch.Tensor) -> torch.Tensor:
        dt = _dtensor(local, mesh, src, shape, False, leaf=False)
        return dt.redistribute(mesh, dst).to_local()

    local = _fake_local(FakeTensorMode(), shape, dtype, src, mesh, False)
    gm = make_fx(run, tracing_mode="fake")(local)
    return tuple(_read_graph(gm.graph, len(gm.graph.nodes), mesh, profile)[2])
