"""Facts about ops that several parts of dtcompile read, written once.

- **Names**: :func:`op_name` (``mm`` for ``aten.mm.default``), the one way every pass,
  the memory model, the SPMD typing, reshard and auto-parallel name an op.
- **Collectives**: :data:`COLLECTIVE_OPS` (each functional collective, and dtcompile's
  fused collective-matmuls, with its kind and where its group and bytes are),
  :data:`WAIT` and :data:`ALL_GATHER`; :mod:`dtcompile.graph.collectives` reads nodes with them.
- **Ordering barriers**: :func:`is_ordering_barrier`, a node that communicates, or may, in a
  way dtcompile does not know (P2P, c10d's own ops, effectful or mutating custom ops), read
  with :data:`COMMUNICATION_NAMESPACES` and :data:`LOCAL_NAMESPACES`: nothing that
  communicates moves across one, in dtcompile's passes or in Inductor's.
- **View and reshape families**: what passes values through unchanged, or moves them
  without computing, grouped by what the op does (:data:`RESHAPES`, :data:`TRANSPOSES`,
  :data:`UNIT_DIMS`, :data:`COPIES`, :data:`CUTS`), and each reader's set built from the
  families, named for the question it answers (:data:`GRADIENT_PASSTHROUGH`,
  :data:`SPMD_TYPE_PRESERVING`, :data:`PADDING_RESHAPES`, :data:`UNSHARD_OPS`,
  :data:`MATMUL_RESHAPES`, :data:`NO_WORK`; in Dynamo's graph :data:`VIEW_METHODS`).  The readers ask different questions, so their sets
  differ; a new op goes into its family here, and every reader whose set holds the
  family sees it.

``tests/architecture/test_op_facts.py`` fails when another module defines such a table
or its own ``_op_name``.
"""

from __future__ import annotations

import enum
import operator
from collections.abc import Iterator
from typing import Any

import torch
from torch import fx

__all__ = [
    "ALL_GATHER",
    "CollectiveKind",
    "COLLECTIVE_OPS",
    "COMMUNICATION_NAMESPACES",
    "COPIES",
    "CUTS",
    "GRADIENT_PASSTHROUGH",
    "LOCAL_NAMESPACES",
    "MATMUL_RESHAPES",
    "NO_WORK",
    "PADDING_RESHAPES",
    "RESHAPES",
    "SPMD_TYPE_PRESERVING",
    "TRANSPOSES",
    "UNIT_DIMS",
    "UNSHARD_OPS",
    "VIEW_FUNCTIONS",
    "VIEW_METHODS",
    "WAIT",
    "is_ordering_barrier",
    "op_name",
]

_c10d = torch.ops._c10d_functional
_aten = torch.ops.aten

WAIT = _c10d.wait_tensor.default
"""``wait_tensor``: where a functional collective's result is read."""
ALL_GATHER = _c10d.all_gather_into_tensor.default


def op_name(target: Any) -> str:
    """``mm`` for ``aten.mm.default`` (an op overload's packet name), ``getitem`` for
    ``operator.getitem``, ``""`` for anything else (a higher-order op, a Python function)."""
    if isinstance(target, torch._ops.OpOverload):
        return target.overloadpacket.__name__
    return "getitem" if target is operator.getitem else ""


class CollectiveKind(str, enum.Enum):
    """What a collective does, whatever op issues it (a functional collective, its coalesced
    form, a fused collective-matmul).  A ``str``: it compares, prints, formats, serializes and
    reprs as its value (``all_gather``), so the records and keys that hold one read as text."""

    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"
    ALL_TO_ALL = "all_to_all"
    BROADCAST = "broadcast"

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:
        return repr(self.value)

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


# (namespace, op name) -> (kind, index of the group-name argument, whether its bytes are
# the output's); dtcompile's fused ops (dtcompile/base/fused_ops.py) count as the collective they contain.
COLLECTIVE_OPS: dict[tuple[str, str], tuple[CollectiveKind, int, bool]] = {
    ("_c10d_functional", "all_gather_into_tensor"): (CollectiveKind.ALL_GATHER, 2, True),
    ("_c10d_functional", "all_gather_into_tensor_coalesced"): (CollectiveKind.ALL_GATHER, 2, True),
    ("_c10d_functional", "reduce_scatter_tensor"): (CollectiveKind.REDUCE_SCATTER, 3, False),
    ("_c10d_functional", "reduce_scatter_tensor_coalesced"): (CollectiveKind.REDUCE_SCATTER, 3, False),
    ("_c10d_functional", "all_reduce"): (CollectiveKind.ALL_REDUCE, 2, False),
    ("_c10d_functional", "all_reduce_coalesced"): (CollectiveKind.ALL_REDUCE, 2, False),
    ("_c10d_functional", "all_to_all_single"): (CollectiveKind.ALL_TO_ALL, 3, False),
    ("_c10d_functional", "broadcast"): (CollectiveKind.BROADCAST, 2, False),
    ("dtcompile", "fused_all_gather_matmul"): (CollectiveKind.ALL_GATHER, 3, True),
    ("dtcompile", "fused_matmul_reduce_scatter"): (CollectiveKind.REDUCE_SCATTER, 5, False),
}

COMMUNICATION_NAMESPACES = frozenset({
    "c10d", "c10d_functional", "_c10d_functional", "_c10d_functional_autograd", "_dtensor", "symm_mem",
})
"""Namespaces whose ops communicate: c10d's process-group ops (``c10d::send``,
``allreduce_``, ``barrier``...), the functional collectives (today's ``_c10d_functional``,
the legacy ``c10d_functional``, the autograd ones), DTensor's ``_dtensor::shard_dim_alltoall``
and symmetric memory's ``symm_mem::`` kernels.  Every op there that is not in
:data:`COLLECTIVE_OPS` nor a wait is an ordering barrier, functional or not
(``_c10d_functional::isend`` / ``irecv`` / ``batch_p2p_ops``, ``all_reduce_``...)."""

LOCAL_NAMESPACES = frozenset({"aten", "prims", "profiler", "inductor", "fsdp"})
"""Namespaces of torch's own ops that compute on this rank and issue nothing, also where they
mutate or are marked effectful: ATen and prims (``aten::_print`` is effectful, in-place ops
mutate), the profiler's range markers, Inductor's memory and accumulation ops
(``resize_storage_bytes_``, ``accumulate_grad_``), FSDP2's copy-in and split copies (its
collectives are separate ``_c10d_functional`` nodes)."""

_WAIT_NAMES = frozenset({"wait_tensor", "wait_tensors"})
_EFFECT_WRAPPERS = {"with_effects": 1, "auto_functionalized": 0, "auto_functionalized_v2": 0}
"""Higher-order ops that wrap an effectful or mutating op, by name -> where the op is in ``args``."""
_OPAQUE_CALLS = frozenset({"call_torchbind", "invoke_leaf_function"})
"""Higher-order ops that run code no graph shows: a script object's method (a ``ProcessGroup``
is one), a Python function."""


def _declared_op_communicates(op: Any) -> bool:
    """Whether ``op``, declared effectful or mutating (the caller knows), may communicate."""
    if isinstance(op, torch._ops.HigherOrderOperator):
        return op.name() != "print"  # torch's print writes to this rank's stream
    if not isinstance(op, torch._ops.OpOverload):
        return True
    if op.namespace in COMMUNICATION_NAMESPACES:
        return _unknown_communication(op)
    return (op.namespace, op._opname) not in COLLECTIVE_OPS and op.namespace not in LOCAL_NAMESPACES


def _unknown_communication(op: torch._ops.OpOverload) -> bool:
    """For an op of :data:`COMMUNICATION_NAMESPACES`: not a known collective, not a wait."""
    return (op.namespace, op._opname) not in COLLECTIVE_OPS and op._opname not in _WAIT_NAMES


def _bodies(node: fx.Node) -> Iterator[fx.GraphModule]:
    """The subgraphs a higher-order op node runs (its ``get_attr`` arguments that are graphs)."""
    root = node.graph.owning_module
    for arg in node.args:
        if isinstance(arg, fx.Node) and arg.op == "get_attr" and root is not None:
            body = operator.attrgetter(arg.target)(root)
            if isinstance(body, fx.GraphModule):
                yield body


def is_ordering_barrier(node: fx.Node) -> bool:
    """Whether ``node`` communicates, or may, and is none of the functional collectives and
    waits dtcompile knows (:data:`COLLECTIVE_OPS`, :data:`WAIT`): an op whose place among
    the graph's communication dtcompile cannot judge, so nothing that communicates may move
    across it.

    Read on the ATen-level graphs dtcompile's passes see (AOTAutograd's, a ``make_fx`` step),
    where every call is an op overload or a higher-order op.  A node is a barrier when it is

    - an op of :data:`COMMUNICATION_NAMESPACES` that is not a known collective nor a wait
      (``wait_tensor``, ``wait_tensors``: they issue nothing): P2P (``_c10d_functional::isend``,
      ``irecv``, ``batch_p2p_ops``, what Dynamo makes of ``dist.isend`` / ``irecv`` /
      ``batch_isend_irecv`` with ``enable_p2p_compilation``), c10d's own ops, in-place
      functional collectives, DTensor's and symmetric memory's;
    - any other op outside :data:`LOCAL_NAMESPACES` that mutates an input or has effects
      (``Node.is_impure``: a mutable schema, an effect registered with
      ``torch.library._register_effectful_op`` or a script-object argument, torch's
      side-effect table), such as a ``torch.library.custom_op`` that communicates (torchcomms'
      comm ops are effectful through their communicator argument).  dtcompile's own fused
      collective-matmuls are known collectives, not barriers;
    - ``with_effects`` or ``auto_functionalized(_v2)`` (how AOTAutograd keeps such an op,
      effectful or mutating) around such an op, or around a higher-order op other than torch's
      ``print``;
    - ``call_torchbind`` or ``invoke_leaf_function``: they run a method or a function that no
      graph shows;
    - a higher-order op whose body (a subgraph argument: a ``local_map`` region, ``cond``...)
      holds a barrier.

    A custom op that is functional and has no effects is not a barrier: nothing in its schema
    says it communicates, and counting every one (a fused attention, a user's kernel) would
    freeze the order of every graph using one.  One that does communicate must say so, with
    an effect or a mutated argument, as torch itself asks (else Inductor may reorder,
    deduplicate or drop it too).  Likewise a Triton kernel (``triton_kernel_wrapper_*``)
    is taken to compute on this rank.
    """
    if node.op != "call_function":
        return False
    target = node.target
    if isinstance(target, torch._ops.HigherOrderOperator):
        name = target.name()
        if name in _EFFECT_WRAPPERS:
            return _declared_op_communicates(node.args[_EFFECT_WRAPPERS[name]])
        if name in _OPAQUE_CALLS:
            return True
        return any(is_ordering_barrier(inner) for body in _bodies(node) for inner in body.graph.nodes)
    if not isinstance(target, torch._ops.OpOverload):
        return False
    if target.namespace in COMMUNICATION_NAMESPACES:
        return _unknown_communication(target)
    return node.is_impure(impure_random=False) and _declared_op_communicates(target)


# ---- families (op names)

RESHAPES = frozenset({"view", "_unsafe_view", "reshape"})
"""The same elements in another shape."""
TRANSPOSES = frozenset({"t", "permute", "transpose"})
"""The same elements with their dims reordered."""
UNIT_DIMS = frozenset({"squeeze", "unsqueeze"})
"""A dim of size one taken away or added."""
COPIES = frozenset({"clone", "contiguous", "_to_copy", "alias"})
"""The same values, possibly in new memory (``_to_copy``: possibly another dtype)."""
CUTS = frozenset({"slice", "narrow", "split", "split_with_sizes", "chunk"})
"""A part of one dim."""

# ---- each reader's set

GRADIENT_PASSTHROUGH = RESHAPES | TRANSPOSES | UNIT_DIMS | COPIES | {"expand"}
"""Auto-parallel: ops whose backward only moves the gradient (a view of it), so a
``Partial`` gradient passes through them and the value they read is the one their
result stands for (:mod:`dtcompile.auto_parallel.edges`, ``problem``)."""

SPMD_TYPE_PRESERVING = RESHAPES | UNIT_DIMS | COPIES | {
    "detach", "lift_fresh_copy", "view_as_complex", "view_as_real", "_conj",
}
"""SPMD typing: ops whose result has its one input's type (a shard dim moves with the
shape: :mod:`dtcompile.spmd.inference`'s shard rule follows it)."""

PADDING_RESHAPES = RESHAPES | TRANSPOSES | {"contiguous", "clone", "cat", "split", "split_with_sizes", "chunk", "getitem"}
"""Ops DTensor puts between a padded shard and its collective, or between a collective's
result and the slice that takes the padding off (:func:`dtcompile.graph.rank_dependence.padded_collective`)."""

UNSHARD_OPS = RESHAPES | TRANSPOSES | UNIT_DIMS | COPIES | CUTS | {
    "cat", "convert_element_type", "_to_dtype", "all_gather_into_tensor", "wait_tensor",
}
"""Reshard: what may stand between a parameter's shard and the gathered weight its users
read (:mod:`dtcompile.pipeline.reshard`)."""

NO_WORK = RESHAPES | TRANSPOSES | UNIT_DIMS | {
    "expand", "slice", "select", "split", "split_with_sizes", "alias", "as_strided", "wait_tensor",
}
"""The roofline (:mod:`dtcompile.cost.simulate`): ops that move no data (views, and the wait
whose collective is timed on its own)."""

MATMUL_RESHAPES = (_aten.view.default, _aten.reshape.default, _aten._unsafe_view.default)
"""Async TP: the reshapes (overloads) between a matmul's 2-D operand or result and the
3-D activation (:mod:`dtcompile.passes.async_tp`)."""

# ---- Dynamo's graph (torch functions and tensor methods, before AOTAutograd)

VIEW_METHODS = frozenset({
    "view", "view_as", "reshape", "reshape_as", "narrow", "t", "transpose", "swapaxes", "permute", "movedim",
    "unsqueeze", "squeeze", "expand", "expand_as", "select", "flatten", "unflatten", "split", "chunk", "unbind",
    "diagonal", "__getitem__", "contiguous", "detach",
})
"""View and shape methods: an output only these make from an input is a view of it to
AOTAutograd, also where DTensor moved data to make it (narrow of a sharded dim gathers
first), so its local shard shares no storage with the input's (:mod:`dtcompile.pipeline.dynamo_output`)."""
VIEW_FUNCTIONS = frozenset({
    torch.narrow, torch.t, torch.transpose, torch.swapaxes, torch.permute, torch.movedim, torch.unsqueeze,
    torch.squeeze, torch.select, torch.flatten, torch.split, torch.chunk, torch.unbind, torch.diagonal,
    torch.reshape, operator.getitem, torch.detach,
})
"""The torch functions of :data:`VIEW_METHODS`."""
