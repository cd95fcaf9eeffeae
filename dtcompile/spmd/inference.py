"""SPMD types in the compiled graphs: plain tensors typed per mesh axis, as ``spmd_types`` types them.

torchtitan's default path (``spmd_backend="spmd_types"``) runs tensor parallelism on
plain tensors: each carries, per mesh axis, one of ``spmd_types``' local types,
``R`` (replicate), ``I`` (invariant), ``V`` (varying; ``S(d)`` where it is a shard of
dim ``d``) or ``P`` (partial sum), and explicit collectives move values between them.
None of it reaches the graph: the types live in a Python attribute, and a
forgotten all-reduce is found only by ``spmd_types``' eager checker (off by default).

Here the types reach the graph and are checked there:

- :func:`input_types` reads each Dynamo graph input's type when it is compiled: the
  tensor's own ``spmd_types`` annotation (``assert_type``; torchtitan's trainer types
  the model's inputs so), or, for a parameter FSDP2 gathered, the compute type FSDP2
  saved for it (``FSDPParam`` restores it on the gathered tensor only under
  ``spmd_types``' type checking).  An input with neither is untyped: ``?``.
- :func:`type_graph` carries them through an AOT graph, node by node, with
  ``spmd_types``' own rule for local types (``R``/``I``/``V``/``P``, by how the op
  treats partial sums: linear, multilinear or not), the collectives' own
  contracts (an all-reduce or reduce-scatter takes ``P``, an all-gather ``V``), and
  the shard dims of ``S(d)`` through views, transposes and matmuls, so that a matmul
  contracting a dim both sides shard gives ``P`` (the partial sum a row-parallel
  linear leaves).  Each node gets ``node.meta[Meta.SPMD_TYPE]``, printed ``tp:S(0) dp:R``.
- In a forward (or inference) graph, a node whose inputs' types contradict the
  rules is a compile-time :class:`SpmdTypeCheckError` naming the node, the op,
  the types and the line of the model: a partial sum added to a replicated value
  (a missing all-reduce), a partial sum through a non-linear op, a value reduced
  twice, a partial sum gathered.  ``spmd_types``' check, for compiled code.

What is not known is not guessed: an untyped input is ``?`` on every axis, and so
is what is computed from it, until a collective says what its output is.  The
check covers the typed part of the graph.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from dtcompile.base.channels import GraphKind, Meta
from dtcompile.base.notation import source_of
from dtcompile.base.op_facts import SPMD_TYPE_PRESERVING, TRANSPOSES, op_name

__all__ = ["AxisTypes", "SpmdType", "SpmdTypeCheckError", "axis_objects", "format_types", "input_types", "type_graph"]


class SpmdType(str):
    """One mesh axis's SPMD type: ``R``, ``I``, ``V``, ``P``, ``S(d)`` (varying: a shard of dim
    ``d``) or ``?`` (unknown).  Its text is the type as printed and compared (``t == "P"``);
    :attr:`local` and :attr:`dim` are read from the value, not parsed back from the text."""

    local: str
    """The local type: ``V`` for ``S(d)``, else the type itself."""
    dim: int | None
    """The dim ``S(d)`` shards, else ``None``."""

    def __new__(cls, local: str, dim: int | None = None) -> SpmdType:
        if isinstance(local, SpmdType):
            return local
        if local not in ("R", "I", "V", "P", "?"):
            raise ValueError(f"not an SPMD type: {local!r} (R, I, V, P, ? or SpmdType.shard(d))")
        if dim is not None and local != "V":
            raise ValueError(f"only a varying value shards a dim; got {local!r} with dim {dim}")
        self = super().__new__(cls, f"S({dim})" if dim is not None else local)
        self.local, self.dim = local, dim
        return self

    @classmethod
    def shard(cls, dim: int) -> SpmdType:
        """``S(dim)``: varying, a shard of ``dim``."""
        return cls("V", dim)

    @classmethod
    def of_text(cls, text: str) -> SpmdType:
        """The type printed ``text`` (``"S(1)"``, ``"P"``): what JSON kept of one."""
        if text.startswith("S(") and text.endswith(")"):
            return cls.shard(int(text[2:-1]))
        return cls(text)

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled as what it is made from (its text alone is not a constructor argument).
        return (SpmdType, (self.local, self.dim))


R, I, V, P, UNKNOWN = (SpmdType(t) for t in ("R", "I", "V", "P", "?"))
AxisTypes = dict[str, SpmdType]
"""Mesh axis name -> its :class:`SpmdType`."""


class SpmdTypeCheckError(TypeError):
    """A compiled graph's SPMD types contradict its collectives (a missing or doubled reduction)."""


def format_types(types: Mapping[str, SpmdType] | None) -> str:
    """``tp:S(0) dp:R`` (axes in name order); ``""`` for none."""
    return " ".join(f"{axis}:{t}" for axis, t in sorted((types or {}).items()))


# ---- reading the inputs' types


def _axis_names(group_names: Sequence[str], axes: Mapping[str, str]) -> dict[Any, str]:
    """spmd_types ``MeshAxis`` -> mesh axis name, the name the graph's collectives are annotated
    with (:func:`dtcompile.graph.collectives.axis_name`): spmd_types' current mesh's names, then those of
    the graph's groups (``group_names``; ``axes``: group name -> axis name)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    from dtcompile.graph.collectives import axis_name

    spmd = sys.modules["spmd_types"]
    names: dict[Any, str] = {}
    for name, axis in (spmd.current_mesh_all_names() or {}).items():
        names.setdefault(axis, name)
    # Last, the default group, named as its collectives are ("world").
    world = [torch.distributed.group.WORLD.group_name] if torch.distributed.is_initialized() else []
    for group_name in [*axes, *group_names, *world]:
        try:
            names.setdefault(spmd.MeshAxis.of(_resolve_process_group(group_name)), axis_name(group_name, axes))
        except Exception:  # a group spmd_types cannot lay out (a fake one): its axes keep their own names
            continue
    return names


def axis_objects(gm: fx.GraphModule, axes: Mapping[str, str]) -> dict[str, Any]:
    """Mesh axis name -> ``spmd_types``' axis of that name (what a type is stamped with), for
    the graph's groups and ``spmd_types``' current mesh; ``{}`` without ``spmd_types``."""
    if "spmd_types" not in sys.modules:
        return {}
    from dtcompile.graph.collectives import group_names_in

    found: dict[str, Any] = {}
    for axis, name in _axis_names(group_names_in(gm), axes).items():
        found.setdefault(name, axis)  # the current mesh's axis first
    return found


def _fsdp_compute_types() -> dict[int, tuple[Any, Any]]:
    """id(gathered parameter) -> (local type, partition spec) FSDP2 saved for it at ``fully_shard``
    (``FSDPParam._spmd_restore_type``), for every FSDP2 module alive."""
    from torch.distributed import _composable_state

    found: dict[int, tuple[Any, Any]] = {}
    for ref in list(getattr(_composable_state, "_module_state_mapping", {}).values()):
        state = ref()
        # The list: the singular property refuses a module with several groups (per-param meshes, MoE).
        groups = getattr(state, "_fsdp_param_groups", None) or ()
        for fsdp_param in (p for group in groups for p in getattr(group, "fsdp_params", None) or ()):
            restore = getattr(fsdp_param, "_spmd_restore_type", None)
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            if restore and unsharded is not None:
                found[id(unsharded)] = (restore, getattr(fsdp_param, "_spmd_partition_spec", None))
    return found


def _types_from(local_type: Mapping[Any, Any], spec: Any, names: Mapping[Any, str]) -> AxisTypes:
    spmd = sys.modules["spmd_types"]
    types = {names.get(axis, str(axis)): SpmdType.shard(t.dim) if isinstance(t, spmd.Shard) else SpmdType(repr(t))
             for axis, t in local_type.items()}
    for dim, entry in enumerate(spec or ()):
        for axis in entry if isinstance(entry, tuple) else (entry,):
            if axis is not None and not isinstance(axis, str):
                types[names.get(axis, str(axis))] = SpmdType.shard(dim)
    return types


def input_types(gm: fx.GraphModule, example_inputs: Sequence[Any], axes: Mapping[str, str]) -> tuple[AxisTypes | None, ...]:
    """Each input of Dynamo graph ``gm``: its SPMD type per mesh axis name, or None where it has
    none; ``()`` where no input is typed (``spmd_types`` not imported, or nothing annotated)."""
    spmd = sys.modules.get("spmd_types")
    if spmd is None:
        return ()
    from spmd_types.runtime import get_partition_spec

    from dtcompile.graph.collectives import group_names_in

    fsdp = _fsdp_compute_types()
    raw: list[tuple[Any, Any] | None] = []
    for value in example_inputs:
        local_type = spmd.get_local_type(value) if isinstance(value, torch.Tensor) else None
        if local_type:
            raw.append((local_type, get_partition_spec(value)))
        else:
            raw.append(fsdp.get(id(value)) if isinstance(value, torch.Tensor) else None)
    if all(r is None for r in raw):
        return ()
    names = _axis_names(group_names_in(gm), axes)
    return tuple(_types_from(*r, names) if r is not None else None for r in raw)


# ---- the rules


def _op_spec(target: Any) -> Any:
    """spmd_types' registered spec (linearity) for the torch function an aten op implements."""
    from spmd_types._checker import _OP_REGISTRY

    name = op_name(target)
    name = {"_unsafe_view": "view", "alias": "view_as", "_to_copy": "clone", "expand_copy": "expand"}.get(name, name)
    for owner in (torch, torch.Tensor):
        fn = getattr(owner, name, None)
        if fn is not None and fn in _OP_REGISTRY:
            return _OP_REGISTRY[fn]
    return None


def _local_rule(node: fx.Node, axis: str, operands: list[tuple[int, str]], scalars: bool) -> str:
    """spmd_types' local type of ``node``'s output on ``axis`` from its operands' (arg index, type)."""
    import spmd_types as spmd
    from spmd_types._checker import OpLinearity, _infer_local_type_for_axis_raw
    from spmd_types._scalar_sentinel import _Scalar

    spec = _op_spec(node.target)
    linearity = spec.linearity if spec is not None else OpLinearity.NONLINEAR
    by_name = {"R": spmd.R, "I": spmd.I, "V": spmd.V, "P": spmd.P}
    for index, t in operands:
        if spec is not None and index in spec.nonlinear_args and t == "P":
            raise spmd.SpmdTypeError(f"argument {index} enters the op non-linearly, and is partial on {axis!r}")
    kinds = [by_name[t.local] for _, t in operands] + ([_Scalar] if scalars else [])
    try:
        return SpmdType(repr(_infer_local_type_for_axis_raw(axis, kinds, linearity=linearity)))
    except spmd.SpmdTypeError:
        if spmd.I not in kinds:
            raise
    # A forward graph cannot tell R from I (the two differ in their backward only): a collective's
    # output is R here, and meets invariant values (torchtitan's norms without sequence parallel).
    as_r = [spmd.R if k is spmd.I else k for k in kinds]
    found = _infer_local_type_for_axis_raw(axis, as_r, linearity=linearity)
    return I if found is spmd.R else SpmdType(repr(found))


def _shape(value: Any) -> tuple[int, ...] | None:
    return tuple(int(s) for s in value.shape) if isinstance(value, torch.Tensor) else None


def _first_shape(value: Any) -> tuple[int, ...] | None:
    """The shape of a value, or of the first tensor of a multi-output op's."""
    if isinstance(value, (list, tuple)):
        return next((_shape(v) for v in value if isinstance(v, torch.Tensor)), None)
    return _shape(value)


def _view_dim(in_shape: Sequence[int], out_shape: Sequence[int], dim: int) -> int | None:
    """Where a view puts sharded dim ``dim``: the output dim that starts at the same flat
    offset and whose size divides the input dim's (the outermost of a split), or that
    the input dim is the outermost of (a merge); None if the shard is scattered."""
    before = math.prod(in_shape[:dim])
    prefix = 1
    for out_dim, size in enumerate(out_shape):
        if prefix == before and size != 1:
            if in_shape[dim] % size == 0 or size % in_shape[dim] == 0:
                return out_dim
            return None
        prefix *= size
        if prefix > before:
            return None
    return None


# Ops that cut along one dim (argument 1, or ``dim=``; split's is argument 2): a shard of another dim stays.
_CUTS = {"slice": 1, "split": 2, "split_with_sizes": 2, "chunk": 2, "narrow": 1}
# Reductions over dims (argument 1, a dim or a list; keepdim argument 2): a shard of a dim not
# reduced stays, moved left by the dims removed before it.
_REDUCTIONS = {"sum", "mean", "amax", "amin"}
# Attention over (batch, heads, sequence, head dim): heads sharded alike on q, k and v stay sharded.
_ATTENTION = {"_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
              "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention"}


def _shard_rule(node: fx.Node, axis: str, typed: list[tuple[fx.Node, int, SpmdType]], local: SpmdType) -> SpmdType:
    """Refines local type ``local`` (``V`` or ``P``) with shard dims where the op's inputs
    are ``S(d)``: views and transposes move the dim, matmuls contract it into ``P``."""
    name = op_name(node.target)
    out_shape = _first_shape(node.meta.get("val"))
    dims = [t.dim for _, _, t in typed]
    if local != "V" or out_shape is None:
        return local
    if name in SPMD_TYPE_PRESERVING and len(typed) == 1 and dims[0] is not None:
        in_shape = _shape(typed[0][0].meta.get("val"))
        found = _view_dim(in_shape, out_shape, dims[0]) if in_shape is not None else None
        return SpmdType.shard(found) if found is not None else V
    if name in _CUTS and dims[0] is not None:
        rank = len(_shape(typed[0][0].meta["val"]) or ())
        position = _CUTS[name]
        cut = node.args[position] if len(node.args) > position else node.kwargs.get("dim", 0)
        return SpmdType.shard(dims[0]) if cut % rank != dims[0] else V
    if name in _ATTENTION and len(typed) >= 3 and dims[:3] == [1, 1, 1]:
        return SpmdType.shard(1)
    if name in TRANSPOSES and dims[0] is not None:
        rank = len(out_shape)
        if name == "t":
            order = list(range(rank))[::-1]
        elif name == "transpose":
            a, b = (d % rank for d in node.args[1:3])
            order = list(range(rank))
            order[a], order[b] = order[b], order[a]
        else:
            order = [d % rank for d in node.args[1]]
        return SpmdType.shard(order.index(dims[0]))
    if name in ("mm", "bmm") and len(typed) == 2:
        (a, b), batch = dims, 1 if name == "bmm" else 0
        ta, tb = (t.local for _, _, t in typed)
        if batch and a == 0 and b == 0:
            return SpmdType.shard(0)  # the batch, sharded on both sides
        if a == batch + 1 and b == batch:
            return P  # the contracted dim, sharded on both sides: each rank holds a partial sum
        if a == batch and tb in ("R", "I"):
            return SpmdType.shard(batch)  # the rows
        if b == batch + 1 and ta in ("R", "I"):
            return SpmdType.shard(batch + 1)
        return V
    if torch.Tag.pointwise in getattr(node.target, "tags", ()):
        # Broadcast from the right: every sharded operand's dim lands on the same output dim.
        landed = {len(out_shape) - len(_shape(n.meta["val"]) or ()) + d for (n, _, _), d in zip(typed, dims) if d is not None}
        plain_varying = any(d is None and t.local == "V" for (_, _, t), d in zip(typed, dims))
        return SpmdType.shard(landed.pop()) if len(landed) == 1 and not plain_varying else V
    if name == "expand" and len(typed) == 1 and dims[0] is not None:
        # New dims come in front; a shard of a dim broadcast from size 1 is no shard of the output.
        in_shape = _shape(typed[0][0].meta["val"]) or ()
        moved = dims[0] + len(out_shape) - len(in_shape)
        return SpmdType.shard(moved) if out_shape[moved] == in_shape[dims[0]] else V
    if name in _REDUCTIONS and len(typed) == 1 and dims[0] is not None:
        reduced = node.args[1] if len(node.args) > 1 else None
        in_rank = len(_shape(typed[0][0].meta["val"]) or ())
        reduced = [reduced] if isinstance(reduced, int) else reduced
        reduced_dims = set(range(in_rank)) if not reduced else {d % in_rank for d in reduced}
        if dims[0] in reduced_dims:
            return P if name == "sum" else V  # a mean (or max) of a shard is not a partial one
        keepdim = len(node.args) > 2 and node.args[2]
        return SpmdType.shard(dims[0] if keepdim else dims[0] - sum(d < dims[0] for d in reduced_dims))
    return V


@dataclass(frozen=True)
class _Collective:
    axis: str
    takes: tuple[str, ...]
    gives: SpmdType
    what: str


# A collective's contract, by kind (:func:`dtcompile.graph.collectives.collective_kind`): the local types
# it takes, the type it gives on its axis, and how a message says what it does.
_CONTRACTS = {
    "all_reduce": (("P", "V"), R, "all-reduces"),
    "reduce_scatter": (("P", "V"), SpmdType.shard(0), "reduce-scatters"),
    "all_gather": (("V", "R", "I"), R, "all-gathers"),
    "all_to_all": (("V",), V, "all-to-alls"),
}


def _collective(node: fx.Node, axes: Mapping[str, str]) -> _Collective | None:
    from dtcompile.graph.collectives import axis_name, collective_kind

    found = collective_kind(node)
    if found is None or found[0] not in _CONTRACTS:
        return None
    kind, group = found
    return _Collective(axis_name(group, axes) if isinstance(group, str) else UNKNOWN, *_CONTRACTS[kind])


def _misused(c: _Collective, t: SpmdType) -> str | None:
    local = t.local
    if local in c.takes or local == UNKNOWN:
        return None
    if local in ("R", "I"):
        return f"{c.what} a value already replicated on {c.axis!r} ({t}): it is reduced twice"
    return f"{c.what} a partial sum on {c.axis!r}: it is gathered unreduced"


# ---- the graph


def _producer(node: fx.Node, axis: str) -> str:
    """The node that made ``node``'s value partial on ``axis``, walking back through linear steps."""
    seen = node
    while True:
        types = seen.meta.get(Meta.SPMD_TYPE) or {}
        parents = [a for a in seen.all_input_nodes if (a.meta.get(Meta.SPMD_TYPE) or {}).get(axis) == "P"]
        if types.get(axis) != "P" or not parents:
            return f"{seen.name} ({seen.target})"
        seen = parents[0]


def _input_types_of(gm: fx.GraphModule, kind: GraphKind, inputs: Sequence[AxisTypes | None],
                    forward: Mapping[str, AxisTypes], forward_outputs: Sequence[AxisTypes | None]) -> dict[fx.Node, AxisTypes | None]:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if kind != GraphKind.BACKWARD:
        return {p: (inputs[i] if i < len(inputs) else None) for i, p in enumerate(placeholders)}
    found: dict[fx.Node, AxisTypes | None] = {}
    tangents = [p for p in placeholders if p.name.startswith("tangents_")]
    for p in placeholders:
        if p in tangents:
            k = tangents.index(p)
            out = forward_outputs[k] if k < len(forward_outputs) else None
            # The gradient of an output: spmd_types' backward type (R <-> P, V, I and S(d) stay).
            found[p] = {a: {"R": P, "P": R}.get(t, t) for a, t in out.items()} if out else None
        else:
            found[p] = forward.get(p.name)
    return found


def type_graph(gm: fx.GraphModule, kind: GraphKind, inputs: Sequence[AxisTypes | None], axes: Mapping[str, str],
               forward: Mapping[str, AxisTypes] | None = None,
               forward_outputs: Sequence[AxisTypes | None] = (), *,
               check: bool = True) -> tuple[dict[str, AxisTypes], list[AxisTypes | None]]:
    """Types every node of an AOT graph (``node.meta[Meta.SPMD_TYPE]``) from its inputs' types
    (a forward's: the Dynamo graph's inputs; a backward's: the forward's saved values by name
    and its outputs' backward types).  Returns (node name -> types, the outputs' types).
    With ``check``, raises :class:`SpmdTypeCheckError` in a forward or inference graph whose
    types contradict: the backend checks the graph as traced, before its passes rewrite it,
    and types it again, unchecked, as lowered."""
    import spmd_types as spmd

    axis_set = sorted({a for t in inputs if t for a in t})
    check = check and kind != GraphKind.BACKWARD
    of: dict[fx.Node, AxisTypes | None] = _input_types_of(gm, kind, inputs, forward or {}, forward_outputs)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            types = of.get(node)
            if types is not None:
                types = {a: types.get(a, UNKNOWN) for a in axis_set}
        elif node.op == "call_function":
            types = _node_types(node, axis_set, of, axes, check, spmd)
        else:
            continue
        of[node] = types
        if types is not None and _shape(node.meta.get("val")) is not None:
            node.meta[Meta.SPMD_TYPE] = types
    output = next(n for n in gm.graph.nodes if n.op == "output")
    outs = [of.get(a) if isinstance(a, fx.Node) else None for a in output.args[0]]
    return {n.name: t for n, t in of.items() if t is not None}, outs


_HOLDS = {"wait_tensor": 0, "copy": 1, "copy_": 1}


def _node_types(node: fx.Node, axis_set: list[str], of: Mapping[fx.Node, AxisTypes | None], axes: Mapping[str, str],
                check: bool, spmd: Any) -> AxisTypes:
    import operator

    # Ops whose result holds one argument's value: an output of a multi-output op, a collective's
    # result once waited for, a copy's source.
    held = 0 if node.target is operator.getitem else _HOLDS.get(op_name(node.target))
    if held is not None:
        return dict(of.get(node.args[held]) or dict.fromkeys(axis_set, UNKNOWN))
    tensors = [(i, a) for i, a in enumerate(node.args) if isinstance(a, fx.Node)]
    tensors += [(i, a) for i, arg in enumerate(node.args) if isinstance(arg, (list, tuple)) for a in arg if isinstance(a, fx.Node)]
    scalars = any(isinstance(a, (int, float)) and not isinstance(a, bool) for a in node.args[:2])
    collective = _collective(node, axes)
    types: AxisTypes = {}
    for axis in axis_set:
        operands = [(a, i, (of.get(a) or {}).get(axis, UNKNOWN)) for i, a in tensors if _shape(a.meta.get("val")) is not None]
        if collective is not None and collective.axis == axis:
            t = operands[0][2] if operands else UNKNOWN
            problem = _misused(collective, t)
            if problem is not None and check:
                raise SpmdTypeCheckError(_message(node, axis, f"{collective.what} {operands[0][0].name}, which {problem}"))
            types[axis] = collective.gives
            continue
        if not operands:
            types[axis] = R  # a value made here, the same on every rank (a constant, a factory)
            continue
        if any(t == UNKNOWN for _, _, t in operands):
            types[axis] = UNKNOWN
            continue
        if collective is not None:  # another axis: the values stay as they are there
            types[axis] = operands[0][2]
            continue
        try:
            local = _local_rule(node, axis, [(i, t) for _, i, t in operands], scalars)
        except spmd.SpmdTypeError as exc:
            if check:
                found = ", ".join(f"{a.name}: {t}" + (f" (partial since {_producer(a, axis)})" if t == "P" else "")
                                  for a, _, t in operands)
                raise SpmdTypeCheckError(_message(node, axis, f"{exc}; its operands: {found}")) from None
            types[axis] = UNKNOWN
            continue
        types[axis] = _shard_rule(node, axis, operands, local)
    return types


def _message(node: fx.Node, axis: str, what: str) -> str:
    return (
        f"dtcompile: the SPMD types of this graph do not add up on mesh axis {axis!r}: node {node.name} "
        f"({node.target}{source_of(node)}) {what}.\n"
        "A partial sum (P) must be reduced (all_reduce to R, reduce_scatter to S(d)) before it meets a "
        "replicated value or a non-linear op; a replicated value must not be reduced again.  Types are read "
        "from the inputs' spmd_types annotations (spmd_types.assert_type) and FSDP2's saved parameter types."
    )
