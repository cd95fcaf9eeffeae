"""``local_map`` regions kept whole through the trace: one node, with the placements it declares.

On plain tensors a ``local_map`` function runs its body as it is, so tracing the
single-device model would inline the body and lose the region.  While
:func:`tracing_regions` is active, every ``local_map`` function found on the model's
modules (an attribute or class attribute that :func:`dtcompile.hops.local_map_call`
recognises, such as ``RegionAttention.core``) is shadowed on its instance by a
call of hops' own region op, :data:`dtcompile.hops.local_map_region`, below autograd: the
op's ``make_fx`` rule traces the body into a subgraph and records one node, whose
``meta[REGION]`` names the :class:`Region`.  The instance attributes are removed
again on exit (the class keeps its own).

The solver then gives the region exactly one candidate: its declared
``in_placements`` (read), ``out_placements`` (made) and ``in_grad_placements``
(the gradients it hands back), measured by running the ``local_map`` function on
fake DTensors; the applied model calls the ``local_map`` function itself.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx, nn

from dtcompile.base.channels import Meta
from dtcompile.hops import RegionSpec, format_placements, local_map_call, local_map_region

__all__ = ["REGION", "REGION_ARGS", "Region", "tracing_regions", "region_of"]

REGION = Meta.AUTOPARALLEL_REGION
"""The key, in a traced region node's ``meta``, of its index in :func:`tracing_regions`' regions."""
REGION_ARGS = Meta.AUTOPARALLEL_REGION_ARGS
"""The key of the pytree spec of the region call's arguments (its operands are their leaves)."""


@dataclass(frozen=True)
class Region:
    """One ``local_map`` function of the model and its declared placements (per tensor input / output)."""

    fn: Any
    """The ``dtcompile.hops.local_map`` result: what the applied model calls."""
    name: str
    in_placements: tuple[tuple[Any, ...], ...]
    out_placements: tuple[tuple[Any, ...], ...]
    in_grad_placements: tuple[tuple[Any, ...], ...]
    body: Any = None
    """The user's function (what the ``local_map`` result runs on local shards)."""

    def spec(self) -> RegionSpec:
        """The region op's argument: its placements as text (no mesh: the trace has none)."""

        def texts(layouts: tuple[tuple[Any, ...], ...]) -> tuple[str | None, ...]:
            return tuple(format_placements(layout) for layout in layouts)

        return RegionSpec(
            self.name, "()", texts(self.in_placements), texts(self.out_placements), texts(self.in_grad_placements)
        )


def region_of(node: fx.Node) -> int | None:
    """The index of the region a traced node is (``None``: not a region)."""
    return node.meta.get(REGION) if node.target is local_map_region else None


def _layouts(value: Any) -> tuple[tuple[Any, ...], ...]:
    from torch.distributed.tensor import Placement

    if value is None:
        return ()
    items = [value] if isinstance(value, Placement) or (
        isinstance(value, (list, tuple)) and value and all(isinstance(p, Placement) for p in value)
    ) else list(value)
    return tuple(tuple(p) if isinstance(p, (list, tuple)) else (p,) for p in items)


def _as_region(value: Any) -> Region | None:
    call = local_map_call(value)
    if call is None:
        return None
    from dtcompile.hops.local_map import region_name

    if isinstance(value, staticmethod):
        value = value.__func__
    ins = _layouts(call.in_placements)
    grads = _layouts(call.in_grad_placements) or ins
    return Region(value, region_name(call.func), ins, _layouts(call.out_placements), grads, call.func)


def _shadow(found: Region, index: int) -> Any:
    def call(*args: Any) -> Any:
        from torch.fx.experimental.proxy_tensor import get_proxy_mode

        flat, in_spec = pytree.tree_flatten(args)
        if any(not isinstance(a, torch.Tensor) for a in flat):
            raise ValueError(f"auto_parallel: local_map region {found.name} takes non-tensor arguments; not supported")
        out_spec: list[Any] = []

        def body(*tensors: Any) -> tuple[Any, ...]:
            leaves, spec = pytree.tree_flatten(found.body(*pytree.tree_unflatten(list(tensors), in_spec)))
            out_spec[:] = [spec]
            return tuple(leaves)

        # Below autograd the op reaches make_fx's rule: one node, the body a subgraph.
        with torch._C._AutoDispatchBelowAutograd():
            outs = local_map_region(body, found.spec(), *flat)
        mode = get_proxy_mode()
        if mode is not None:
            node = next(n for n in reversed(mode.tracer.graph.nodes) if n.target is local_map_region)
            node.meta[REGION] = index
            node.meta[REGION_ARGS] = in_spec
        return pytree.tree_unflatten(list(outs), out_spec[0])

    return call


@contextlib.contextmanager
def tracing_regions(model: nn.Module) -> Iterator[dict[int, Region]]:
    """While active, the model's ``local_map`` functions trace as one region node each;
    yields region index -> :class:`Region`."""
    shadowed: list[tuple[nn.Module, str, Any]] = []
    found: dict[int, Region] = {}
    indices = itertools.count()
    try:
        for module in model.modules():
            # Each name as the instance resolves it (its own, else the first class of its MRO's).
            stored: dict[str, Any] = {}
            for klass in reversed(type(module).__mro__):
                stored.update(vars(klass))
            stored.update(vars(module))
            for attr in sorted(stored):
                if attr.startswith("__"):
                    continue
                value = stored[attr]
                region = _as_region(value)
                if region is None:
                    continue
                index = next(indices)
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


_MISSING = object()

