"""``local_map``, the user API: torch's signature and eager semantics, as one op that keeps its placements.

:func:`local_map` returns a function; calling it checks the placements against
the flat arguments (:func:`make_spec`, the same checks and messages at trace
time) and makes one :data:`~hops.region_op.local_map_region` call.  The
arguments of a call are one declared contract, :class:`LocalMapCall`: the
function ``local_map`` returns is ``functools.partial(_local_map_call,
*LocalMapCall(...))``, and Dynamo (:mod:`dynamo_vars.local_map`) reads them
back by field name.  ``check_placements`` (run on all simulated ranks of a
``LocalTensorMode``, :mod:`dtcompile.hops.check`) verifies that outputs declared
``Replicate()`` agree across their mesh axis and ``Shard`` outputs have
consistent shapes.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as pytree

from dtcompile.base.notation import describe_mesh
from dtcompile.hops.region_op import local_map_region
from dtcompile.hops.spec import (
    LocalMapError,
    RegionSpec,
    counted,
    format_placements,
    mismatch_error,
    other_mesh_error,
    output_count_error,
    placements_of_types,
)

__all__ = ["LocalMapCall", "local_map", "local_map_call", "make_spec", "region_name"]


class LocalMapCall(NamedTuple):
    """The arguments of one ``local_map(...)``: passed positionally, in this order, before the user's."""

    func: Callable[..., Any]
    out_placements: Any
    in_placements: Any
    in_grad_placements: Any
    device_mesh: Any
    redistribute_inputs: bool
    check_placements: bool


def _mesh_text(mesh: Any) -> str:
    return describe_mesh(mesh)[len("DeviceMesh(") : -1]


def region_name(func: Callable[..., Any]) -> str:
    name = getattr(func, "__name__", None) or type(func).__name__
    return re.sub(r"\W", "_", name) or "region"


def _placements_arg(
    name: str, value: Any, what: str, count: int, mesh: Any
) -> tuple[str | None, ...]:
    """One placement string (or None) per flat input/output, checked against the mesh; an
    entry may be SPMD types by mesh axis name (:func:`~dtcompile.hops.spec.placements_of_types`)."""
    ndim = mesh.ndim
    noun = "output" if what == "out_placements" else "input"
    if len(value) != count:
        raise LocalMapError(
            f"local_map {name}: {what} has {counted(len(value), 'entry', 'entries')} but the "
            f"region has {counted(count, noun)} (after flattening the arguments with pytree); give one "
            f"placement tuple per {noun} (None for a non-tensor)"
        )
    texts = []
    for i, ps in enumerate(value):
        if ps is None:
            texts.append(None)
            continue
        if isinstance(ps, Mapping):
            try:
                ps = placements_of_types(ps, mesh, f"{what}[{i}]")
            except ValueError as e:
                raise LocalMapError(f"local_map {name}: {e}") from None
        ps = tuple(ps)
        if len(ps) != ndim:
            raise LocalMapError(
                f"local_map {name}: {what}[{i}] = {ps} has {counted(len(ps), 'placement')} but the mesh has "
                f"{counted(ndim, 'axis', 'axes')}; give one placement per mesh axis"
            )
        try:
            texts.append(format_placements(ps))
        except LocalMapError as e:
            raise LocalMapError(
                f"local_map {name}: {what}[{i}]: {str(e).removeprefix('local_map: ')}"
            ) from None
    return tuple(texts)


def _out_placements_tuple(out_placements: Any) -> tuple[Any, ...]:
    """``out_placements`` per flat output: a single PlacementType means one output."""
    from torch.distributed.tensor.placement_types import Placement

    if out_placements is None:
        return (None,)
    if isinstance(out_placements, tuple) and (
        not out_placements
        or all(p is None or not isinstance(p, Placement) for p in out_placements)
    ):
        return out_placements
    return (out_placements,)


def make_spec(
    name: str,
    mesh: Any,
    flat_args: Sequence[Any],
    in_placements: Sequence[Any] | None,
    in_grad_placements: Sequence[Any] | None,
    out_placements: Any,
    num_outputs: int | None,
    redistribute_inputs: bool,
) -> RegionSpec:
    """Checks a call's placements against its flat inputs and the mesh, and writes them as a spec.

    ``flat_args`` are the flat inputs (DTensors, tensors and other values; at
    trace time their fake values).  Placements not given are the DTensor inputs'
    own; ``in_grad_placements`` default to the input placements.  Only the
    tensor inputs' entries are kept: they are the region's operands.
    """
    from torch.distributed.tensor import DTensor

    if in_placements is None:
        in_texts = tuple(
            format_placements(a.placements) if isinstance(a, DTensor) else None
            for a in flat_args
        )
    else:
        in_texts = _placements_arg(
            name, in_placements, "in_placements", len(flat_args), mesh
        )
    grad_texts = (
        in_texts
        if in_grad_placements is None
        else _placements_arg(
            name, in_grad_placements, "in_grad_placements", len(flat_args), mesh
        )
    )
    for i, a in enumerate(flat_args):
        if isinstance(a, DTensor):
            if a.device_mesh != mesh:
                raise other_mesh_error(name, i, a.device_mesh, mesh)
            if in_texts[i] is None:
                raise LocalMapError(
                    f"local_map {name}: input {i} is a DTensor but in_placements[{i}] is None; "
                    f"give its placements, e.g. {tuple(a.placements)}"
                )
            have = format_placements(a.placements)
            if have != in_texts[i] and not redistribute_inputs:
                raise mismatch_error(name, i, have, in_texts[i])
            if grad_texts[i] is None:
                raise LocalMapError(
                    f"local_map {name}: input {i} is a DTensor but in_grad_placements[{i}] is None; "
                    "give its gradient's placements"
                )
        elif not isinstance(a, torch.Tensor) and in_texts[i] is not None:
            raise LocalMapError(
                f"local_map {name}: input {i} is a {type(a).__name__}, not a tensor, but in_placements[{i}] "
                f"is {in_texts[i]}; give None for non-tensor inputs"
            )
    outs = _out_placements_tuple(out_placements)
    if num_outputs is not None and len(outs) != num_outputs:
        raise output_count_error(name, num_outputs, len(outs))
    out_texts = _placements_arg(name, outs, "out_placements", len(outs), mesh)
    tensor = [i for i, a in enumerate(flat_args) if isinstance(a, torch.Tensor)]
    return RegionSpec(
        name=name,
        mesh=_mesh_text(mesh),
        in_placements=tuple(in_texts[i] for i in tensor),
        out_placements=out_texts,
        in_grad_placements=tuple(grad_texts[i] for i in tensor),
        redistribute_inputs=bool(redistribute_inputs),
    )


def local_map(
    func: Callable[..., Any] | None = None,
    out_placements: Any = None,
    in_placements: Any = None,
    in_grad_placements: Any = None,
    device_mesh: Any = None,
    *,
    redistribute_inputs: bool = False,
    check_placements: bool = False,
) -> Any:
    """``torch.distributed.tensor.experimental.local_map``, as one op that keeps its placements.

    Same signature and eager semantics as torch's (decorator and call forms):
    ``func`` runs on the local shards of the DTensor inputs (flattened with
    pytree; plain tensors and other values are passed as they are) and its
    flat outputs become DTensors placed per ``out_placements``.  In compiled
    code (dynamo_vars installed, e.g. by ``dtcompile.backend()``) the call is one
    ``local_map_region`` node whose arguments carry the placements.

    ``check_placements=True`` (eager, for debugging) verifies the outputs on all
    ranks of a ``LocalTensorMode``: each ``Replicate()`` output must be equal on
    every rank of its mesh axis (a forgotten all-reduce shows up here) and each
    ``Shard(d)`` output must agree in shape across ranks except along ``d``.
    """
    if func is None:
        return functools.partial(
            local_map,
            out_placements=out_placements,
            in_placements=in_placements,
            in_grad_placements=in_grad_placements,
            device_mesh=device_mesh,
            redistribute_inputs=redistribute_inputs,
            check_placements=check_placements,
        )
    call = LocalMapCall(
        func,
        out_placements,
        in_placements,
        in_grad_placements,
        device_mesh,
        redistribute_inputs,
        check_placements,
    )
    return functools.partial(_local_map_call, *call)


def local_map_call(value: Any) -> LocalMapCall | None:
    """The arguments of ``value`` when it is a function :func:`local_map` made (a
    ``staticmethod`` of one too), else ``None``: how other code recognises a region
    (``dtcompile.auto_parallel`` keeps each one whole) without knowing how it is built."""
    if isinstance(value, staticmethod):
        value = value.__func__
    if not (isinstance(value, functools.partial) and value.func is _local_map_call):
        return None
    return LocalMapCall(*value.args[: len(LocalMapCall._fields)])


@torch.compiler.disable
def _local_map_call(*call_and_args: Any, **kwargs: Any) -> Any:
    """One call of a function made by :func:`local_map`: its :class:`LocalMapCall`, then the user's arguments.

    Eager only: in compiled code ``dynamo_vars`` turns a call into one region op.
    Where it cannot (a graph break in the region under ``fullgraph=False``, or
    dynamo_vars not installed), the call runs eagerly, never traced line by line.
    """
    from torch.distributed.tensor import DTensor

    call = LocalMapCall(*call_and_args[: len(LocalMapCall._fields)])
    args = call_and_args[len(LocalMapCall._fields) :]
    func = call.func
    flat_args, args_spec = pytree.tree_flatten(args)
    name = region_name(func)
    mesh = call.device_mesh
    if mesh is None:
        mesh = next((a.device_mesh for a in flat_args if isinstance(a, DTensor)), None)
    if mesh is None or not any(isinstance(a, DTensor) for a in flat_args):
        # No DTensor input: torch's local_map calls func as it is.
        return func(*args, **kwargs)
    spec = make_spec(
        name,
        mesh,
        flat_args,
        call.in_placements,
        call.in_grad_placements,
        call.out_placements,
        None,
        call.redistribute_inputs,
    )
    tensor_at = [i for i, a in enumerate(flat_args) if isinstance(a, torch.Tensor)]
    structure: list[Any] = []

    def body(*tensors: Any) -> tuple[Any, ...]:
        leaves = list(flat_args)
        for i, t in zip(tensor_at, tensors):
            leaves[i] = t
        out = func(*pytree.tree_unflatten(leaves, args_spec), **kwargs)
        flat_out, out_spec = pytree.tree_flatten(out)
        structure[:] = [out_spec]
        if call.check_placements:
            # On the local results, before from_local: a shard shape that differs
            # where it must not is what the check is for, and would not wrap.
            from dtcompile.hops.check import check_region_outputs

            check_region_outputs(spec, mesh, flat_out)
        return tuple(flat_out)

    outs = local_map_region(body, spec, *[flat_args[i] for i in tensor_at])
    return pytree.tree_unflatten(list(outs), structure[0])
