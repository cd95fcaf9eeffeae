"""``local_map`` regions kept whole through the trace: one node, with the placements it declares.

On plain tensors a ``local_map`` function runs its body as it is, so tracing the
single-device model would inline the body and lose the region.  While
:func:`keep_regions` is active, every ``local_map`` function found on the model's
modules (an attribute or class attribute that is a ``hops.local_map`` result,
such as ``RegionAttention.core``) is shadowed on its instance by a call of one
op, ``dtcompile_autoparallel::region(tensors, index)``, which traces as a single
node; its fake implementation runs the body to learn the outputs' shapes.  The
instance attributes are removed again on exit (the class keeps its own).

The solver then gives the region exactly one candidate: its declared
``in_placements`` (read), ``out_placements`` (made) and ``in_grad_placements``
(the gradients it hands back), measured by running the ``local_map`` function on
fake DTensors; the applied model calls the ``local_map`` function itself.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

__all__ = ["Region", "keep_regions", "region_op"]


@dataclass(frozen=True)
class Region:
    """One ``local_map`` function of the model and its declared placements (per tensor input / output)."""

    fn: Any
    """The ``hops.local_map`` result: what the applied model calls."""
    name: str
    in_placements: tuple[tuple[Any, ...], ...]
    out_placements: tuple[tuple[Any, ...], ...]
    in_grad_placements: tuple[tuple[Any, ...], ...]


_ACTIVE: dict[int, tuple[Region, list[Any]]] = {}
"""Region index -> (region, [output pytree spec]) while :func:`keep_regions` is active."""
_INDEX = itertools.count()


@functools.cache
def region_op() -> Any:
    """The op a region traces as (defined on first use: importing this module registers nothing)."""

    @torch.library.custom_op("dtcompile_autoparallel::region", mutates_args=())
    def region(tensors: list[torch.Tensor], index: int) -> list[torch.Tensor]:
        raise RuntimeError("dtcompile_autoparallel::region only traces; the applied model calls the region itself")

    @region.register_fake
    def _(tensors: list[torch.Tensor], index: int) -> list[torch.Tensor]:
        found, spec = _ACTIVE[index]
        out = found.fn.args[0](*tensors)  # the local_map function's body, on the fake tensors
        flat, out_spec = pytree.tree_flatten(out)
        spec[:] = [out_spec]
        return [t.clone() for t in flat]

    return region


def _layouts(value: Any) -> tuple[tuple[Any, ...], ...]:
    from torch.distributed.tensor import Placement

    if value is None:
        return ()
    items = [value] if isinstance(value, Placement) or (
        isinstance(value, (list, tuple)) and value and all(isinstance(p, Placement) for p in value)
    ) else list(value)
    return tuple(tuple(p) if isinstance(p, (list, tuple)) else (p,) for p in items)


def _as_region(value: Any) -> Region | None:
    from hops import local_map_call
    from hops.local_map import region_name

    call = local_map_call(value)
    if call is None:
        return None
    if isinstance(value, staticmethod):
        value = value.__func__
    ins = _layouts(call.in_placements)
    grads = _layouts(call.in_grad_placements) or ins
    return Region(value, region_name(call.func), ins, _layouts(call.out_placements), grads)


def _shadow(found: Region, index: int) -> Any:
    def call(*args: Any) -> Any:
        flat = pytree.tree_leaves(args)
        if any(not isinstance(a, torch.Tensor) for a in flat):
            raise ValueError(f"auto_parallel: local_map region {found.name} takes non-tensor arguments; not supported")
        outs = region_op()(list(flat), index)
        return pytree.tree_unflatten(list(outs), _ACTIVE[index][1][0])

    return call


@contextlib.contextmanager
def keep_regions(model: nn.Module) -> Iterator[dict[int, Region]]:
    """While active, the model's ``local_map`` functions trace as one region node each;
    yields region index -> :class:`Region`."""
    shadowed: list[tuple[nn.Module, str, Any]] = []
    found: dict[int, Region] = {}
    try:
        for module in model.modules():
            names = {n for klass in type(module).__mro__ for n in vars(klass)} | set(vars(module))
            for attr in sorted(names):
                if attr.startswith("__"):
                    continue
                value = inspect_attr(module, attr)
                region = _as_region(value)
                if region is None:
                    continue
                index = next(_INDEX)
                _ACTIVE[index] = (region, [])
                found[index] = region
                shadowed.append((module, attr, vars(module).get(attr, _MISSING)))
                object.__setattr__(module, attr, _shadow(region, index))
        yield found
    finally:
        for module, attr, before in reversed(shadowed):
            if before is _MISSING:
                object.__delattr__(module, attr)
            else:
                object.__setattr__(module, attr, before)
        for index in found:
            _ACTIVE.pop(index, None)


_MISSING = object()


def inspect_attr(module: nn.Module, attr: str) -> Any:
    """The attribute as stored (a class's staticmethod unwrapped by the lookup), without calling properties."""
    if attr in vars(module):
        return vars(module)[attr]
    for klass in type(module).__mro__:
        if attr in vars(klass):
            return vars(klass)[attr]
    return None
