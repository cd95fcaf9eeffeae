"""Facts about ops that several parts of dtcompile read, written once.

- **Names**: :func:`op_name` (``mm`` for ``aten.mm.default``), the one way every pass,
  the memory model, the SPMD typing, reshard and auto-parallel name an op.
- **Collectives**: :data:`COLLECTIVE_OPS` (each functional collective, and dtcompile's
  fused collective-matmuls, with its kind and where its group and bytes are),
  :data:`WAIT` and :data:`ALL_GATHER`; :mod:`dtcompile.collectives` reads nodes with them.
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

import operator
from typing import Any

import torch

__all__ = [
    "ALL_GATHER",
    "COLLECTIVE_OPS",
    "COPIES",
    "CUTS",
    "GRADIENT_PASSTHROUGH",
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


# (namespace, op name) -> (kind, index of the group-name argument, whether its bytes are
# the output's); dtcompile's fused ops (dtcompile/ops.py) count as the collective they contain.
COLLECTIVE_OPS: dict[tuple[str, str], tuple[str, int, bool]] = {
    ("_c10d_functional", "all_gather_into_tensor"): ("all_gather", 2, True),
    ("_c10d_functional", "all_gather_into_tensor_coalesced"): ("all_gather", 2, True),
    ("_c10d_functional", "reduce_scatter_tensor"): ("reduce_scatter", 3, False),
    ("_c10d_functional", "reduce_scatter_tensor_coalesced"): ("reduce_scatter", 3, False),
    ("_c10d_functional", "all_reduce"): ("all_reduce", 2, False),
    ("_c10d_functional", "all_reduce_coalesced"): ("all_reduce", 2, False),
    ("_c10d_functional", "all_to_all_single"): ("all_to_all", 3, False),
    ("_c10d_functional", "broadcast"): ("broadcast", 2, False),
    ("dtcompile", "fused_all_gather_matmul"): ("all_gather", 3, True),
    ("dtcompile", "fused_matmul_reduce_scatter"): ("reduce_scatter", 5, False),
}

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
shape: :mod:`dtcompile.spmd_typing`'s shard rule follows it)."""

PADDING_RESHAPES = RESHAPES | TRANSPOSES | {"contiguous", "clone", "cat", "split", "split_with_sizes", "chunk", "getitem"}
"""Ops DTensor puts between a padded shard and its collective, or between a collective's
result and the slice that takes the padding off (:func:`dtcompile.rank_dependence.padded_collective`)."""

UNSHARD_OPS = RESHAPES | TRANSPOSES | UNIT_DIMS | COPIES | CUTS | {
    "cat", "convert_element_type", "_to_dtype", "all_gather_into_tensor", "wait_tensor",
}
"""Reshard: what may stand between a parameter's shard and the gathered weight its users
read (:mod:`dtcompile.reshard`)."""

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
first), so its local shard shares no storage with the input's (:mod:`dtcompile.dynamo_output`)."""
VIEW_FUNCTIONS = frozenset({
    torch.narrow, torch.t, torch.transpose, torch.swapaxes, torch.permute, torch.movedim, torch.unsqueeze,
    torch.squeeze, torch.select, torch.flatten, torch.split, torch.chunk, torch.unbind, torch.diagonal,
    torch.reshape, operator.getitem, torch.detach,
})
"""The torch functions of :data:`VIEW_METHODS`."""
