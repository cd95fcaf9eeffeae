"""Sizes of possibly symbolic shapes, read without guarding on them.

Under dynamic shapes (``dynamic=True``, or Dynamo's automatic dynamic after a
size changed) a size in a graph's fake values is a ``SymInt``.  ``int()``,
``float()`` or a comparison on it adds a guard that specializes the compiled
code to this size: the next size recompiles.  dtcompile reads sizes only for
costs, byte counts and reports, so it reads their hints (the sizes of the
example inputs) through these functions, which never guard; passes that would
build new ops from a symbolic shape skip that value instead (:func:`is_symbolic`).

Bottom layer: imports nothing of dtcompile's, and torch only inside functions.
"""

from __future__ import annotations

from typing import Any

__all__ = ["hint", "is_symbolic", "nbytes_hint", "numel_hint", "shape_hint"]

# The size assumed for a data-dependent (unbacked) size, which has no hint.
UNBACKED_HINT = 8192


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
