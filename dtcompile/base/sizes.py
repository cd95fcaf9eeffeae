"""Sizes of possibly symbolic shapes, read without guarding on them.

Under dynamic shapes (``dynamic=True``, or Dynamo's automatic dynamic after a
size changed) a size in a graph's fake values is a ``SymInt``.  ``int()``,
``float()`` or a comparison on it adds a guard that specializes the compiled
code to this size: the next size recompiles.  dtcompile reads sizes only for
costs, byte counts and reports, so it reads their hints (the sizes of the
example inputs) through these functions, which never guard; passes that would
build new ops from a symbolic shape skip that value instead (:func:`is_symbolic`).

A data-dependent size (unbacked: the split sizes of a MoE's token dispatch,
read from a tensor with ``.tolist()`` under ``capture_scalar_outputs``) has no
hint: it reads as :data:`UNBACKED_HINT`, an estimate that costs and budgets
use and reports do not show as a number (:func:`has_unbacked` tells them).

Bottom layer: imports nothing of dtcompile's, and torch only inside functions.
"""

from __future__ import annotations

from typing import Any

__all__ = ["UNBACKED_HINT", "has_unbacked", "hint", "is_symbolic", "nbytes_hint", "numel_hint", "shape_hint"]

UNBACKED_HINT = 8192
"""The estimate for each data-dependent (unbacked) size, which has no hint:
``u0 + u1`` reads as 16384 (torch's ``optimization_hint`` fallback)."""


def hint(size: Any) -> int:
    """``size`` as an int: its hint if it is symbolic (no guard is added)."""
    import torch
    from torch.fx.experimental.symbolic_shapes import optimization_hint

    if isinstance(size, torch.SymInt):
        return int(optimization_hint(size, fallback=UNBACKED_HINT))
    return int(size)


def shape_hint(value: Any) -> tuple[int, ...]:
    return tuple(hint(s) for s in value.shape)


def numel_hint(value: Any) -> int:
    return hint(value.numel())


def nbytes_hint(value: Any) -> int:
    return numel_hint(value) * value.element_size()


def is_symbolic(value: Any) -> bool:
    """Whether a tensor's shape has a size that is not a plain int."""
    import torch

    return any(isinstance(s, torch.SymInt) and s.node.maybe_as_int() is None for s in value.shape)


def has_unbacked(*values: Any) -> bool:
    """Whether a size in ``values`` (tensors, sizes, lists of them; anything else is
    ignored) is data-dependent: an unbacked symbol, which no example input fixes."""
    import torch
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
    from torch.utils import _pytree as pytree

    leaves = [v for v in pytree.tree_leaves(list(values)) if isinstance(v, (torch.Tensor, torch.SymInt))]
    # A graph of static shapes (most: every collective of a trace without dynamic shapes) has
    # no symbol to look for; torch's walk of each size's expression is the dear part.
    if not any(_has_symbol(v) for v in leaves):
        return False
    return bool(free_unbacked_symbols(leaves))


def _has_symbol(value: Any) -> bool:
    """Whether a SymInt, or a tensor's sizes, strides or storage offset (what torch reads of a
    tensor for its symbols) hold a symbolic int."""
    import torch

    if isinstance(value, torch.SymInt):
        return True
    if value.layout != torch.strided or value.is_nested:
        return True  # (sparse and nested sizes: torch's own walk)
    return any(isinstance(s, torch.SymInt) for s in (*value.shape, *value.stride(), value.storage_offset()))
