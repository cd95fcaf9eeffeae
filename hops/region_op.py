"""The region op, ``local_map_region(body, spec, *operands)``: one implementation per dispatch key.

- ``body`` is a callable (a ``GraphModule`` once traced) that takes the local
  shards and returns a flat tuple of local tensors;
- ``spec`` is a :class:`~hops.spec.RegionSpec` (or its text, which is the op's
  argument);
- ``operands`` are tensors: DTensors (checked against, or redistributed to, the
  declared input placements and handed to ``body`` as their local shards) or
  plain tensors (handed over as they are, as ``local_map`` does).

Keys:

- Autograd: DTensor operands are unwrapped here (``to_local`` with the declared
  gradient placements, outputs wrapped with ``from_local``), so DTensor's own
  autograd handles the global/local boundary.  On plain tensors: outside
  :func:`keep_regions` the region is simply run (inlined into whatever traces
  it, which is what ``aot_eager`` and ``inductor`` get); inside it (the dtcompile
  backend), the region's forward and backward are traced and partitioned once
  (:mod:`dtcompile.hops.joint`), and the forward and the backward are each one
  ``local_map_region`` call, the backward's spec saying ``backward=True``.
- Functionalization: unwrap, run the functionalized body, wrap.
- FakeTensorMode: run the body on fake tensors.
- ProxyTorchDispatchMode: trace the body into a subgraph of the traced module
  and record one call node.
- CompositeExplicitAutograd (eager, real tensors): run the body.
- DTensor, LocalTensor, LocalTensorMode (reached below autograd).
- Selective activation checkpointing's caching and cached modes: redirected to
  the mode, as torch's own HOPs are, so a region under
  ``torch.utils.checkpoint`` with a SAC policy is saved or recomputed as one op.

A forward region and its backward are paired by an explicit call id in
``node.meta["custom"]["dtcompile_region_call"]`` of both region nodes (as
``invoke_subgraph`` pairs its calls), set while the op is traced.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._C import DispatchKey
from torch._higher_order_ops.utils import (
    redirect_to_mode,
    reenter_make_fx,
    register_fake,
    unique_graph_id,
)
from torch._ops import HigherOrderOperator
from torch.fx.experimental.proxy_tensor import ProxyTorchDispatchMode, track_tensor_tree
from torch.utils.checkpoint import _CachedTorchDispatchMode, _CachingTorchDispatchMode

from dtcompile.base.channels import Meta
from dtcompile.hops.joint import Joint, call_body, joint_graphs
from dtcompile.hops.spec import (
    LocalMapError,
    RegionSpec,
    format_placements,
    mismatch_error,
    other_mesh_error,
    output_count_error,
    parse_placements,
)

__all__ = [
    "REGION_CALL",
    "check_output_kinds",
    "keep_regions",
    "local_map_region",
    "region_call_id",
    "regions_kept",
]

REGION_CALL = Meta.REGION_CALL
"""The key, in a region node's ``meta["custom"]``, of the id that pairs a forward region with its backward."""


_state = threading.local()


@contextlib.contextmanager
def keep_regions(flag: bool = True) -> Iterator[None]:
    """Inside the block, traced regions (and their backward) stay ``local_map_region`` nodes.

    Outside it a region is inlined into whatever traces it, so any backend gets
    plain ops.  The dtcompile backend turns it on while AOTAutograd traces, and
    inlines the regions itself just before lowering.
    """
    # One joint cache per block (one compile): identical layers trace their region once.
    with _swapped_state("keep", flag), _swapped_state("joint_cache", {}):
        yield


@contextlib.contextmanager
def _swapped_state(name: str, value: Any) -> Iterator[None]:
    """This thread's ``_state.<name>`` is ``value`` inside the block, and as it was after."""
    missing = object()
    before = getattr(_state, name, missing)
    setattr(_state, name, value)
    try:
        yield
    finally:
        if before is missing:
            delattr(_state, name)
        else:
            setattr(_state, name, before)


def regions_kept() -> bool:
    return getattr(_state, "keep", False)


_CALL_IDS = itertools.count()


def region_call_id(node: torch.fx.Node) -> int | None:
    """The id pairing a region node with its forward or backward (None if it has none)."""
    return (node.meta.get("custom") or {}).get(REGION_CALL)


class LocalMapRegion(HigherOrderOperator):
    """``local_map_region(body, spec, *operands) -> tuple of tensors``.

    ``spec`` is a :class:`RegionSpec` or its text; the op's argument is the text
    (a string survives every FX pass, pickle and cache key as it is).
    """

    def __init__(self) -> None:
        super().__init__("dtcompile_local_map")

    def __call__(
        self, body: Callable[..., Any], spec: RegionSpec | str, *operands: Any
    ) -> tuple[Any, ...]:
        return super().__call__(body, str(spec), *operands)


local_map_region = LocalMapRegion()


def _dtensor_boundary(
    body: Callable[..., Any], spec: RegionSpec | str, operands: Sequence[Any]
) -> tuple[Any, ...]:
    """DTensor operands in, DTensor outputs out: the region itself runs on local shards."""
    spec = RegionSpec.of(spec)
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import DTensor

    mesh = None
    local = []
    for i, x in enumerate(operands):
        if not isinstance(x, DTensor):
            local.append(x)
            continue
        if mesh is None:
            mesh = x.device_mesh
        elif x.device_mesh != mesh:
            raise other_mesh_error(spec.name, i, x.device_mesh, mesh)
        want = spec.in_placements[i]
        x = _to_placements(x, want, spec, i)
        grad = spec.in_grad_placements[i]
        y = x.to_local(
            grad_placements=parse_placements(grad) if grad is not None else None
        )
        if isinstance(y, AsyncCollectiveTensor):
            y = y.wait()
        local.append(y)
    outs = local_map_region(body, spec, *local)
    if mesh is None:
        return outs
    return _wrap_outputs(outs, spec, mesh)


def _wrap_outputs(outs: Sequence[Any], spec: RegionSpec, mesh: Any) -> tuple[Any, ...]:
    from torch.distributed.tensor import DTensor

    if len(outs) != len(spec.out_placements):
        raise output_count_error(spec.name, len(outs), len(spec.out_placements))
    for i, out in enumerate(outs):
        if isinstance(out, DTensor):
            raise LocalMapError(
                f"local_map {spec.name}: output {i} is a DTensor; the region must return local "
                "tensors (call .to_local() inside it, or return the tensor it was made from)"
            )
    check_output_kinds(
        spec.name, [isinstance(out, torch.Tensor) for out in outs], spec.out_placements
    )
    return tuple(
        out
        if p is None
        else DTensor.from_local(out, mesh, parse_placements(p), run_check=False)
        for out, p in zip(outs, spec.out_placements)
    )


def check_output_kinds(
    name: str, is_tensor: Sequence[bool], out_placements: Sequence[str | None]
) -> None:
    """Placements for every tensor output and ``None`` for every other one (eager and trace time)."""
    for i, (tensor, p) in enumerate(zip(is_tensor, out_placements)):
        if tensor and p is None:
            raise LocalMapError(
                f"local_map {name}: output {i} is a tensor but out_placements[{i}] is None; give its placements"
            )
        if not tensor and p is not None:
            raise LocalMapError(
                f"local_map {name}: output {i} is not a tensor but out_placements[{i}] is {p}; "
                "give None for non-tensor outputs"
            )


def _to_placements(x: Any, want: str | None, spec: RegionSpec, index: int) -> Any:
    if want is None:
        return x
    placements = parse_placements(want)
    if tuple(x.placements) == placements:
        return x
    if spec.redistribute_inputs:
        return x.redistribute(placements=placements)
    raise mismatch_error(spec.name, index, format_placements(x.placements), want)


def _has_dtensor(operands: Sequence[Any]) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(x, DTensor) for x in operands)


@local_map_region.py_impl(DispatchKey.Autograd)
def _autograd(
    body: Callable[..., Any], spec: RegionSpec | str, *operands: Any
) -> tuple[Any, ...]:
    spec = RegionSpec.of(spec)
    if _has_dtensor(operands):
        return _dtensor_boundary(body, spec, operands)
    if not regions_kept() or _has_local_tensor(operands):
        # LocalTensor (simulated ranks) runs every op on all ranks at once, collectives
        # included: the region runs op by op, inlined, and only values are simulated.
        return call_body(body, operands)
    needs_grad = torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in operands
    )
    if not needs_grad:
        with torch._C._AutoDispatchBelowAutograd():
            return local_map_region(body, spec, *operands)
    return _RegionFunction.apply(body, spec, *operands)


@local_map_region.py_functionalize_impl
def _functionalize(
    ctx: Any, body: Callable[..., Any], spec: RegionSpec, *operands: Any
) -> tuple[Any, ...]:
    unwrapped = ctx.unwrap_tensors(operands)
    with ctx.redispatch_to_next():
        out = local_map_region(ctx.functionalize(body), spec, *unwrapped)
    return ctx.wrap_tensors(out)


@register_fake(local_map_region, skip_cache=True)
def _fake(
    body: Callable[..., Any], spec: RegionSpec, *operands: Any
) -> tuple[Any, ...]:
    return call_body(body, operands)


@local_map_region.py_impl(ProxyTorchDispatchMode)
def _proxy(
    mode: ProxyTorchDispatchMode,
    body: Callable[..., Any],
    spec: RegionSpec | str,
    *operands: Any,
) -> tuple[Any, ...]:
    spec = RegionSpec.of(spec)
    graph = reenter_make_fx(body)(*operands)
    _, name = unique_graph_id(
        mode, prefix="local_map_body" if not spec.backward else "local_map_backward"
    )
    mode.tracer.root.register_module(name, graph)
    with torch.fx.experimental.proxy_tensor.disable_proxy_modes_tracing():
        example = local_map_region(graph, spec, *operands)
    proxy_args = pytree.tree_map(
        mode.tracer.unwrap_proxy, (graph, str(spec), *operands)
    )
    out = mode.tracer.create_proxy(
        "call_function", local_map_region, proxy_args, {}, name=spec.name
    )
    call_id = getattr(_state, "call_id", None)
    if call_id is not None:
        # Pairs a forward region with its backward (dtcompile's annotations match them by it).
        out.node.meta.setdefault("custom", {})[REGION_CALL] = call_id
    return track_tensor_tree(example, out, constant=None, tracer=mode.tracer)


@local_map_region.py_impl(DispatchKey.CompositeExplicitAutograd)
def _eager(
    body: Callable[..., Any], spec: RegionSpec, *operands: Any
) -> tuple[Any, ...]:
    return call_body(body, operands)


def _dtensor_key(
    body: Callable[..., Any], spec: RegionSpec, *operands: Any
) -> tuple[Any, ...]:
    return _dtensor_boundary(body, spec, operands)


def _local_tensor_mode_key(
    mode: Any, body: Callable[..., Any], spec: RegionSpec, *operands: Any
) -> tuple[Any, ...]:
    with mode:
        return call_body(body, operands)


def _has_local_tensor(operands: Sequence[Any]) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed._local_tensor import LocalTensor

    return any(isinstance(x, LocalTensor) for x in operands)


def _register_subclass_keys() -> None:
    # Reached below autograd (``inference_mode``, or inside another op's forward).
    from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
    from torch.distributed.tensor import DTensor

    local_map_region.py_impl(DTensor)(_dtensor_key)
    # LocalTensor runs every op on all ranks: the body runs as it is (see _autograd).
    local_map_region.py_impl(LocalTensor)(_eager)
    local_map_region.py_impl(LocalTensorMode)(_local_tensor_mode_key)


if torch.distributed.is_available():
    _register_subclass_keys()

# Selective activation checkpointing: the region is saved or recomputed as one op.
redirect_to_mode(local_map_region, _CachingTorchDispatchMode)
redirect_to_mode(local_map_region, _CachedTorchDispatchMode)


class _RegionFunction(torch.autograd.Function):
    """The region's forward and backward, each one ``local_map_region`` call."""

    @staticmethod
    def forward(
        ctx: Any, body: Callable[..., Any], spec: RegionSpec, *operands: Any
    ) -> tuple[Any, ...]:
        joint = joint_graphs(body, spec, operands, getattr(_state, "joint_cache", None))
        # One id for this call's forward region node and its backward's (see REGION_CALL).
        ctx.call_id = next(_CALL_IDS)
        with torch._C._AutoDispatchBelowAutograd(), _swapped_state("call_id", ctx.call_id):
            outs = local_map_region(joint.forward, joint.forward_spec, *operands)
        ctx.joint = joint
        ctx.num_operands = len(operands)
        # What the backward reads: tensors through autograd's saving, sizes (SymInts) as they are.
        saved = outs[joint.num_outputs :]
        ctx.save_for_backward(*(x for x in saved if isinstance(x, torch.Tensor)))
        ctx.saved_sizes = [None if isinstance(x, torch.Tensor) else x for x in saved]
        results = outs[: joint.num_outputs]
        ctx.mark_non_differentiable(
            *(r for i, r in enumerate(results) if i not in joint.grad_outputs)
        )
        return tuple(results)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:
        joint: Joint = ctx.joint
        # Autograd materializes the gradient of an unused output as zeros: none is None.
        tangents = [grads[i].contiguous() for i in joint.grad_outputs]
        tensors = iter(ctx.saved_tensors)
        saved = [next(tensors) if x is None else x for x in ctx.saved_sizes]
        with torch._C._AutoDispatchBelowAutograd(), _swapped_state("call_id", ctx.call_id):
            grad_inputs = local_map_region(
                joint.backward, joint.backward_spec, *saved, *tangents
            )
        result: list[Any] = [None] * ctx.num_operands
        for i, g in zip(joint.grad_inputs, grad_inputs):
            result[i] = g
        return (None, None, *result)
