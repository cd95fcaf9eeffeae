"""The DTensor API in compiled code.

Stock Dynamo traces ``from_local``, ``to_local``, ``redistribute`` and
``full_tensor``; this module covers the rest of what training code calls:

- The factories ``ones, zeros, full, empty`` with ``device_mesh=``
  and ``placements=`` (stock: "Failed to convert args/kwargs to proxy") and
  ``distribute_tensor`` (stock: skipped ``ScatterOptions``) are traced through
  polyfills built from what Dynamo already traces: the local shard is created
  with the local shape, then wrapped with ``DTensor.from_local``.
- The random factories ``rand, randn`` are a named graph break: they run eagerly,
  with DTensor's RNG tracker (which compiled code cannot advance; on a CPU mesh,
  eager refuses them).
- ``compute_local_shape_and_global_offset`` is folded at trace time: its
  inputs (shape, mesh, placements) are constants and its result depends on
  them only (stock: data-dependent ``.item()`` on ``_StridedShard`` offsets).
- ``implicit_replication()`` and ``loss_parallel()``: :mod:`dynamo_vars.dtensor_state`.
- ``redistribute`` and ``full_tensor`` calls, which Dynamo keeps as one call
  each and runs on fake tensors to learn the result, ignore the unbacked
  sizes DTensor's own code makes and drops on the way (stock: a
  ``_StridedShard`` gathered to ``Replicate()`` fails with
  ``PendingUnbackedSymbolNotFound``, from ``.tolist()`` on the fake shard
  offsets in ``_StridedShard.local_shard_size_and_offset``).  A result's shape
  follows from the target placements alone, never from data.
- The DTensor input guard reads ``placements of arg x changed: (Shard(dim=0),)
  -> (Replicate(),)`` and also checks the placements' exact types.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch

from dynamo_vars import guards
from dynamo_vars._trackers import Handler, fold, polyfill
from dynamo_vars.placements import same_placements

__all__: list[str] = []


def _local_shape(size: Any, mesh: Any, placements: Sequence[Any]) -> tuple[int, ...]:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return compute_local_shape_and_global_offset(size, mesh, placements)[0]


def _spec_args(size: tuple[Any, ...], device_mesh: Any, placements: Any) -> tuple[torch.Size, Any, tuple[Any, ...]]:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor._utils import normalize_to_torch_size

    if device_mesh is None:
        from torch.distributed.device_mesh import _mesh_resources

        device_mesh = _mesh_resources.get_current_mesh()
    if placements is None:
        placements = tuple(Replicate() for _ in range(device_mesh.ndim))
    placements = tuple(placements)
    if len(placements) != device_mesh.ndim:
        raise ValueError(
            f"DTensor factory: {len(placements)} placements {placements} for a mesh with "
            f"{device_mesh.ndim} axes; give one placement per mesh axis"
        )
    return normalize_to_torch_size(size), device_mesh, placements


def _wrap_local(local: torch.Tensor, size: torch.Size, mesh: Any, placements: tuple[Any, ...]) -> Any:
    from torch.distributed.tensor import DTensor

    stride = torch._prims_common.make_contiguous_strides_for(size)
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=size, stride=stride)


def _check_layout(layout: torch.layout) -> None:
    if layout != torch.strided:
        raise ValueError(f"DTensor factory: layout {layout} is not supported; use torch.strided")


def _check_requires_grad(requires_grad: bool, name: str) -> None:
    """Run at trace time (folded, see ``ID_HANDLERS``): ``unimplemented`` is a graph break
    only when raised by Dynamo itself, not from code it inlines."""
    if requires_grad:
        from torch._dynamo.exc import unimplemented

        unimplemented(
            gb_type=f"dtcompile: {name}(requires_grad=True) inside a compiled region",
            context=name,
            explanation=(
                f"{name}(requires_grad=True) makes a new leaf tensor (a parameter); Dynamo "
                "cannot create leaves that require grad inside a graph."
            ),
            hints=["Create parameters outside the compiled function (at model setup) and pass them in."],
        )


# The polyfills are plain module-level functions (no closures): Dynamo inlines
# them without a source, and a closure cell would need one for its guard.


def _filled(init, name, size, fill_value, dtype, layout, requires_grad, device_mesh, placements):
    _check_layout(layout)
    _check_requires_grad(requires_grad, name)
    size, mesh, placements = _spec_args(size, device_mesh, placements)
    local_shape = _local_shape(size, mesh, placements)
    if fill_value is None:
        local = init(local_shape, dtype=dtype, device=mesh.device_type)
    else:
        local = init(local_shape, fill_value, dtype=dtype, device=mesh.device_type)
    return _wrap_local(local, size, mesh, placements)


def _refuse_random(name: str) -> None:
    """Run at trace time (folded, see ``ID_HANDLERS``): a DTensor random factory is a graph
    break, so that it runs eagerly with DTensor's own RNG."""
    from torch._dynamo.exc import unimplemented

    unimplemented(
        gb_type=f"dtcompile: DTensor random factory {name}() inside a compiled region",
        context=name,
        explanation=(
            f"torch.distributed.tensor.{name}() draws with DTensor's RNG tracker, whose state compiled "
            "code cannot read or advance (on a mesh without one, a CPU mesh, eager refuses); drawing "
            "with another generator would give other numbers, and replicated shards that need not "
            "agree across ranks. The call runs eagerly (this graph break)."
        ),
        hints=[
            "Draw random DTensors outside the compiled function (at setup), or accept the graph break.",
        ],
    )


def ones(*size, dtype=None, layout=torch.strided, requires_grad=False, device_mesh=None, placements=None):
    return _filled(torch.ones, "ones", size, None, dtype, layout, requires_grad, device_mesh, placements)


def zeros(*size, requires_grad=False, dtype=None, layout=torch.strided, device_mesh=None, placements=None):
    return _filled(torch.zeros, "zeros", size, None, dtype, layout, requires_grad, device_mesh, placements)


def empty(*size, dtype=None, layout=torch.strided, requires_grad=False, device_mesh=None, placements=None):
    return _filled(torch.empty, "empty", size, None, dtype, layout, requires_grad, device_mesh, placements)


def full(size, fill_value, *, dtype=None, layout=torch.strided, requires_grad=False, device_mesh=None, placements=None):
    return _filled(torch.full, "full", size, fill_value, dtype, layout, requires_grad, device_mesh, placements)


def rand(*size, requires_grad=False, dtype=None, layout=torch.strided, device_mesh=None, placements=None):
    _refuse_random("rand")


def randn(*size, requires_grad=False, dtype=None, layout=torch.strided, device_mesh=None, placements=None):
    _refuse_random("randn")


def distribute_tensor(tensor, device_mesh=None, placements=None, *, src_data_rank=0):
    """``distribute_tensor`` as traceable ops: broadcast from ``src_data_rank`` along
    every mesh axis (skipped for ``None``), then keep the local shard."""
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.tensor import DTensor, Replicate

    _check_requires_grad(tensor.requires_grad, "distribute_tensor")
    _, mesh, placements = _spec_args(tensor.shape, device_mesh, placements)
    if isinstance(tensor, DTensor):
        if tensor.device_mesh != mesh or not same_placements(tensor.placements, placements):
            raise ValueError(
                f"distribute_tensor: the tensor is already a DTensor on {tensor.device_mesh} with placements "
                f"{tensor.placements}, not {mesh} with {placements}; use redistribute() instead"
            )
        return tensor
    local = tensor.detach()
    if src_data_rank is not None:
        for axis in range(mesh.ndim):
            local = funcol.broadcast(local, src_data_rank, (mesh, axis))
    replicated = DTensor.from_local(local, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return replicated.redistribute(mesh, placements)


def _dtensor_spec_guard(original: Any) -> Any:
    from torch._dynamo.guards import check_dtensor_spec, extract_dtensor_spec

    @functools.wraps(original)
    def DTENSOR_SPEC_MATCH(self: Any, guard: Any) -> None:
        value = self.get(guard)
        expected = extract_dtensor_spec(guard, value)
        placement_types = tuple(type(p) for p in value.placements)

        def check(x: Any) -> bool:
            return check_dtensor_spec(x, expected) and tuple(type(p) for p in x.placements) == placement_types

        def explain_mesh(old: Any, new: Any) -> str | None:
            if old.mesh == new.mesh:
                return None
            return f"mesh of {{what}} changed: {guards.describe_mesh_change(old.mesh, new.mesh)}"

        def explain_placements(old: Any, new: Any) -> str | None:
            if same_placements(old.placements, new.placements) and old.shard_order == new.shard_order:
                return None
            before, after = guards.describe_placements(old.placements), guards.describe_placements(new.placements)
            if before != after:
                return f"placements of {{what}} changed: {before} -> {after}"
            old_classes = tuple(type(p).__qualname__ for p in old.placements)
            new_classes = tuple(type(p).__qualname__ for p in new.placements)
            if old_classes != new_classes:
                return f"placement classes of {{what}} changed: {old_classes} -> {new_classes} (equal by ==: {before})"
            return f"shard order of {{what}} changed: {old.shard_order} -> {new.shard_order}"

        def explain_rest(old: Any, new: Any) -> str | None:
            return None if check(new) else f"DTensor spec of {{what}} changed: {old} -> {new}"

        parts = {"mesh": explain_mesh, "placements": explain_placements, "spec": explain_rest}
        key = guards.record(expected, parts)
        # The guard is on ``<dtensor>._spec``; the message names the DTensor.
        code = guards.code_parts(key, guard.name, label=guard.name.removesuffix("._spec"))
        self.get_guard_manager(guard).add_lambda_guard(check, code, guard.user_stack)

    return DTENSOR_SPEC_MATCH


GUARD_BUILDERS = {"DTENSOR_SPEC_MATCH": _dtensor_spec_guard}


# DTensor methods whose result's shape is a function of the mesh and placements only.
_SPEC_SHAPED_METHODS = frozenset({"redistribute", "full_tensor"})


def _dtensor_method_call(original: Any) -> Any:
    @functools.wraps(original)
    def call_method(self: Any, tx: Any, name: str, args: Any, kwargs: Any) -> Any:
        shape_env = tx.fake_mode.shape_env if tx.fake_mode is not None else None
        if name in _SPEC_SHAPED_METHODS and shape_env is not None and _is_dtensor(self):
            with shape_env.ignore_fresh_unbacked_symbols():
                return original(self, tx, name, args, kwargs)
        return original(self, tx, name, args, kwargs)

    return call_method


def _is_dtensor(variable: Any) -> bool:
    from torch.distributed.tensor import DTensor

    try:
        return issubclass(variable.python_type(), DTensor)
    except NotImplementedError:
        return False


def _explain_dtensor_errors(original: Any) -> Any:
    """Dynamo's fake run of one node: DTensor's errors get what was wrong and the fix."""

    @functools.wraps(original)
    def get_fake_value(node: Any, tx: Any, *args: Any, **kwargs: Any) -> Any:
        # Read before the call: from torch 2.14 on, a node that fails is erased
        # from the graph, its arguments with it.
        inputs = list(node.all_input_nodes)
        try:
            return original(node, tx, *args, **kwargs)
        except Exception as e:
            advice = _two_meshes_advice(node, inputs) if "different meshes" in str(e) else None
            if advice is None:
                raise
            explained = type(e)(f"{e}\n\ndtcompile: {advice}")
            # Dynamo's own attributes (the user's stack of an observed exception) stay.
            explained.__dict__.update(e.__dict__)
            raise explained from e.__cause__

    return get_fake_value


def _two_meshes_advice(node: Any, inputs: list[Any]) -> str | None:
    from torch.distributed.tensor import DTensor

    operands = [
        (re.sub(r"^l_(.+)_$", r"\1", arg.name), arg.meta["example_value"])
        for arg in inputs
        if isinstance(arg.meta.get("example_value"), DTensor)
    ]
    meshes = {}
    for name, value in operands:
        meshes.setdefault(guards.describe_mesh(value.device_mesh), []).append(name)
    if len(meshes) < 2:
        return None
    listed = "; ".join(f"{', '.join(names)} on {mesh}" for mesh, names in meshes.items())
    return (
        f"{node.target.__name__ if callable(node.target) else node.target} takes DTensors on "
        f"{len(meshes)} meshes ({listed}), and a DTensor op runs on one mesh. Give every operand "
        "the same mesh: build them on the parent mesh, one placement per axis (Replicate() on an "
        "axis a tensor is not split over), or move one with DTensor.from_local(x.to_local(), "
        "mesh, placements) where its local values are what that mesh's placements say."
    )


def _unflatten_keeping_shard_order(original: staticmethod) -> staticmethod:
    """``DTensor.__tensor_unflatten__`` that rebuilds the spec it was given.

    View propagation makes specs whose ``_StridedShard`` placements are plain
    shards with an explicit ``shard_order`` (``use_strided_shard_as_shard_order
    =False``); stock unflatten rebuilds them without that flag, and DTensorSpec
    refuses ("doesn't allow specify shard_order"): ``(x * 2).view(-1)`` of a
    ``Shard(1)`` DTensor failed in AOTAutograd (also with ``aot_eager``).
    """
    unflatten = original.__func__

    def __tensor_unflatten__(inner_tensors, flatten_spec, outer_size, outer_stride):
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
        from torch.distributed.tensor.placement_types import _StridedShard

        placements, tensor_meta, shard_order, requires_grad = flatten_spec
        if shard_order is None or not any(isinstance(p, _StridedShard) for p in placements):
            return unflatten(inner_tensors, flatten_spec, outer_size, outer_stride)
        spec = DTensorSpec(
            inner_tensors["device_mesh"],
            placements,
            tensor_meta=TensorMeta(shape=outer_size, stride=outer_stride, dtype=tensor_meta.dtype),
            shard_order=shard_order,
            use_strided_shard_as_shard_order=False,
        )
        return DTensor(inner_tensors["_local_tensor"], spec, requires_grad=requires_grad)

    return staticmethod(__tensor_unflatten__)


def WRAPPED() -> dict[tuple[Any, str], Callable[[Any], Any]]:
    from torch._dynamo import utils
    from torch._dynamo.variables.tensor import TensorVariable
    from torch.distributed.tensor import DTensor

    return {
        (TensorVariable, "call_method"): _dtensor_method_call,
        (utils, "_get_fake_value_impl"): _explain_dtensor_errors,
        (DTensor, "__tensor_unflatten__"): _unflatten_keeping_shard_order,
    }


def ID_HANDLERS() -> dict[Callable[..., Any], Handler]:
    import torch.distributed.tensor as dtensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return {
        dtensor.ones: polyfill(ones),
        dtensor.zeros: polyfill(zeros),
        dtensor.empty: polyfill(empty),
        dtensor.full: polyfill(full),
        dtensor.rand: polyfill(rand),
        dtensor.randn: polyfill(randn),
        dtensor.distribute_tensor: polyfill(distribute_tensor),
        compute_local_shape_and_global_offset: fold,
        _check_requires_grad: fold,
        _refuse_random: fold,
    }
