"""DeviceMesh in compiled code.

Stock torch registers ``DeviceMesh`` as an opaque reference type: reads such as
``ndim``, ``shape``, ``size()``, ``get_coordinate()`` and ``get_local_rank()``
are evaluated on the real mesh at trace time and guarded through the mesh's
``guard_fn`` (layout, device, names, ranks).  That stays; this module adds:

- ``get_all_groups()``, which stock refuses ("unregistered member"): inlined,
  it is ``get_group(i)`` for every axis, already supported;
- ``init_device_mesh`` and ``DeviceMesh(...)`` inside a compiled region: a
  structured graph break that says to build the mesh outside (building one
  communicates);
- ``mesh[...]._flatten(name)`` on a mesh made in the compiled code (a
  submesh): stock runs ``_flatten`` on the fake mesh and fails ("Please
  convert all Tensors to FakeTensors first").  Flattening makes a process
  group, as eager does at that point: it runs on the real mesh while Dynamo
  traces (every rank traces the same code), after which the traced call only
  reads the flattened mesh back;
- the mesh guard reports a failure as ``mesh changed: DeviceMesh((tp=4)) ->
  DeviceMesh((dp=2, tp=2)) (arg m)`` instead of ``___check_opaque_guard_fn_<id>``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from dynamo_vars import guards
from dynamo_vars._trackers import Handler, graph_break

__all__: list[str] = []


def OPAQUE_MEMBERS() -> dict[type, dict[str, Any]]:
    from torch._library.opaque_object import MemberType
    from torch.distributed.device_mesh import DeviceMesh

    return {DeviceMesh: {"get_all_groups": MemberType.INLINED}}


_BUILD_OUTSIDE = [
    (
        "Create the mesh before the compiled function (at model setup) and pass it in, "
        "close over it, or keep it as a module attribute."
    ),
]


def ID_HANDLERS() -> dict[Callable[..., Any], Handler]:
    from torch.distributed.device_mesh import init_device_mesh

    return {
        init_device_mesh: graph_break(
            "init_device_mesh creates process groups, which communicates with every rank; "
            "it cannot be part of a compiled graph.",
            _BUILD_OUTSIDE,
        ),
    }


def _flatten_on_the_real_mesh(original: Any) -> Any:
    @functools.wraps(original)
    def call_method(self: Any, tx: Any, name: str, args: Any, kwargs: Any) -> Any:
        if name == "_flatten":
            from torch._subclasses.fake_tensor import unset_fake_temporarily
            from torch.distributed.device_mesh import DeviceMesh

            mesh = self.as_python_constant()
            if isinstance(mesh, DeviceMesh):
                const_args = [a.as_python_constant() for a in args]
                const_kwargs = {k: v.as_python_constant() for k, v in kwargs.items()}
                with unset_fake_temporarily():
                    mesh._flatten(*const_args, **const_kwargs)
        return original(self, tx, name, args, kwargs)

    return call_method


def WRAPPED() -> dict[tuple[Any, str], Callable[[Any], Any]]:
    from dtcompile.base.torch_compat import script_object_variable

    return {(script_object_variable(), "call_method"): _flatten_on_the_real_mesh}


def _mesh_guard(original: Any) -> Any:
    """``OPAQUE_OBJ_GUARD_FN_MATCH`` for meshes, with a readable failure."""
    from torch._dynamo.guards import check_opaque_obj, extract_opaque_obj
    from torch.distributed.device_mesh import DeviceMesh

    @functools.wraps(original)
    def OPAQUE_OBJ_GUARD_FN_MATCH(self: Any, guard: Any) -> None:
        value = self.get(guard)
        if not isinstance(guards.real_object(value), DeviceMesh):
            return original(self, guard)
        expected_values = extract_opaque_obj(guard, value)
        expected_mesh = guards.real_object(value)

        def check(x: Any) -> bool:
            return check_opaque_obj(x, expected_values)

        def explain_shape(_: Any, new: Any) -> str | None:
            if guards.describe_mesh(new) == guards.describe_mesh(expected_mesh):
                return None
            return f"mesh changed: {guards.describe_mesh_change(expected_mesh, new)} ({{what}})"

        def explain_rest(_: Any, new: Any) -> str | None:
            if check(new):
                return None
            return f"mesh changed: {guards.describe_mesh_change(expected_mesh, new)} ({{what}})"

        # Two parts: Dynamo evaluates the parts of a failed guard only when there are several.
        key = guards.record(expected_mesh, {"shape": explain_shape, "ranks": explain_rest})
        self.get_guard_manager(guard).add_lambda_guard(check, guards.code_parts(key, guard.name), guard.user_stack)

    return OPAQUE_OBJ_GUARD_FN_MATCH


GUARD_BUILDERS = {"OPAQUE_OBJ_GUARD_FN_MATCH": _mesh_guard}
