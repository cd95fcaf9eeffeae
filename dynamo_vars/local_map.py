"""``hops.local_map`` in compiled code: one ``local_map_region`` node per call.

Stock Dynamo inlines ``local_map`` (the region and its placements are gone
before a backend sees them), and its own local_map HOP, off by default,
asserts on DTensor inputs, wants ``None`` placements last and the mesh given.
Here a call to a function made by :func:`hops.local_map` becomes:

1. the call's placements checked against its flat arguments (the same checks,
   and messages, as eager: :func:`hops.local_map.make_spec`), DTensor
   arguments redistributed in the graph when ``redistribute_inputs=True``;
2. the region traced as a subgraph at local shapes: for the trace, each
   DTensor argument's example value is its local shard; closures over plain
   tensors are lifted as operands; side effects are refused;
3. one ``local_map_region(body, spec, *operands)`` node, whose
   :class:`~hops.RegionSpec` carries the placements of each operand and output,
   and whose outputs are DTensors placed per ``out_placements``.

Nested argument and result structures are flattened as pytree does, so the
placements line up with eager's.  A call without DTensor arguments calls the
function as it is (as eager does).  ``check_placements=True`` needs every
rank's values, so that call runs eagerly (a graph break that says so).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._dynamo.exc import Unsupported, unimplemented
from torch._dynamo.variables.base import VariableTracker
from torch._dynamo.variables.higher_order_ops import (
    WrapHigherOrderVariable,
    _call_function_with_auto_output_flattening,
)
from torch._dynamo.variables.lazy import LazyVariableTracker
from torch._dynamo.variables.lists import BaseListVariable, ListVariable, TupleVariable

from dynamo_vars.guards import real_object

__all__: list[str] = []


def _constant(vt: VariableTracker) -> Any:
    """The Python value of an argument that must be known at trace time (placements, mesh, flags)."""
    vt = LazyVariableTracker.realize_all(vt)
    if isinstance(vt, BaseListVariable):
        items = [_constant(item) for item in vt.items]
        return items if isinstance(vt, ListVariable) else tuple(items)
    try:
        return vt.as_python_constant()
    except NotImplementedError:
        pass
    if hasattr(vt, "value"):
        return real_object(vt.value)
    _refuse(
        "local_map argument that is not a constant",
        f"{vt} is a traced value where local_map needs a value known at trace time "
        "(placements, device_mesh, redistribute_inputs, non-tensor arguments)",
        "Pass placements, meshes and non-tensor arguments as Python values, not as results of traced ops.",
    )


def _refuse(what: str, explanation: str, hint: str) -> None:
    unimplemented(
        gb_type=f"dtcompile: {what}",
        context="local_map",
        explanation=explanation,
        hints=[hint],
    )


def _flatten(
    vt: VariableTracker, leaves: list[VariableTracker]
) -> Callable[[list[VariableTracker]], VariableTracker]:
    """Flattens tuples and lists of ``vt`` into ``leaves`` (pytree's order); returns the rebuilder."""
    vt = LazyVariableTracker.realize_all(vt)
    if isinstance(vt, (TupleVariable, ListVariable)):
        parts = [_flatten(item, leaves) for item in vt.items]

        def rebuild(new: list[VariableTracker]) -> VariableTracker:
            items = [part(new) for part in parts]
            if isinstance(vt, TupleVariable):
                return TupleVariable(items)
            from torch._dynamo.variables.base import ValueMutationNew

            return ListVariable(items, mutation_type=ValueMutationNew())

        return rebuild
    index = len(leaves)
    leaves.append(vt)
    return lambda new: new[index]


def _example(vt: VariableTracker) -> Any:
    if vt.is_tensor():
        return vt.as_proxy().node.meta["example_value"]
    return _constant(vt)


def _local_fake(tx: Any, dtensor: Any) -> torch.Tensor:
    local = dtensor._local_tensor
    with tx.fake_mode:
        return torch.empty_strided(
            local.shape,
            local.stride(),
            dtype=local.dtype,
            device=local.device,
            requires_grad=dtensor.requires_grad,
        )


class LocalMapVariable(WrapHigherOrderVariable):
    """A call ``local_map(func, ...)(*args)``: see the module docstring."""

    supports_input_mutation = False
    supports_aliasing = False

    def call_function(
        self,
        tx: Any,
        args: Sequence[VariableTracker],
        kwargs: dict[str, VariableTracker],
    ) -> VariableTracker:
        from torch.distributed.tensor import DTensor

        from hops.local_map import (
            LocalMapError,
            _region_name,
            check_output_kinds,
            format_placements,
            make_spec,
            parse_placements,
        )

        func, out_vt, in_vt, grad_vt, mesh_vt, redistribute_vt, check_vt, *user_args = (
            args
        )
        out_placements, in_placements, in_grad_placements = (
            _constant(v) for v in (out_vt, in_vt, grad_vt)
        )
        mesh, redistribute, check = (
            _constant(v) for v in (mesh_vt, redistribute_vt, check_vt)
        )
        leaves: list[VariableTracker] = []
        rebuild = _flatten(TupleVariable(list(user_args)), leaves)
        values = [_example(vt) for vt in leaves]
        dtensors = [i for i, v in enumerate(values) if isinstance(v, DTensor)]
        if not dtensors:
            # Eager local_map calls func as it is when no argument is a DTensor.
            return func.call_function(tx, list(user_args), kwargs)
        if check:
            _refuse(
                "local_map(check_placements=True) in a compiled region",
                "check_placements compares each output across all simulated ranks; that needs the values, "
                "so the call runs eagerly.",
                "Drop check_placements once the region is checked, or check it in an eager test run.",
            )
        mesh = (
            real_object(mesh)
            if mesh is not None
            else real_object(values[dtensors[0]].device_mesh)
        )
        name = _region_name(
            getattr(func, "fn", None) or getattr(func, "get_function", lambda: func)()
        )

        def checked_spec(what: str, num_outputs: int | None) -> Any:
            """The eager checks and messages (make_spec), as a refusal that names ``what``."""
            try:
                return make_spec(
                    name,
                    mesh,
                    values,
                    in_placements,
                    in_grad_placements,
                    out_placements,
                    num_outputs,
                    redistribute,
                )
            except LocalMapError as e:
                _refuse(what, str(e), _fix_hint(str(e)))

        spec = checked_spec(
            "local_map arguments that do not match its placements", None
        )

        # Redistribute where asked, then trace the body on the local shards.
        tensor_leaves = [i for i, v in enumerate(values) if isinstance(v, torch.Tensor)]
        by_leaf = dict(
            zip(tensor_leaves, zip(spec.in_placements, spec.in_grad_placements))
        )
        for i in dtensors:
            want = by_leaf[i][0]
            if want is not None and format_placements(values[i].placements) != want:
                # Placements are constants to Dynamo (opaque value types): the call
                # is traced as the user's own x.redistribute(placements=...) would be.
                leaves[i] = leaves[i].call_method(
                    tx,
                    "redistribute",
                    [],
                    {"placements": VariableTracker.build(tx, parse_placements(want))},
                )
                values[i] = leaves[i].as_proxy().node.meta["example_value"]
        placement_of = {leaves[i].as_proxy().node: by_leaf[i] for i in tensor_leaves}
        saved = {}
        for i in dtensors:
            node = leaves[i].as_proxy().node
            saved[node] = node.meta["example_value"]
            node.meta["example_value"] = _local_fake(tx, values[i])
            leaves[i].synchronize_attributes(tx)
        user_args = list(rebuild(leaves).items)
        try:
            (p_args, _, example_value, body_r, _, _, output_vts, _) = (
                self.create_wrapped_node(
                    tx,
                    func,
                    user_args,
                    kwargs,
                    "local_map",
                    subgraph_name="local_map_body",
                    set_subgraph_inputs="automatic_with_forced_inputs",
                )
            )
        except Unsupported as e:
            if not any(word in str(e) for word in ("side effect", "mutation")):
                raise
            _refuse(
                "side effect inside a local_map region",
                f"local_map {name}: the region mutates one of its inputs or Python state outside it "
                f"({str(e).splitlines()[0]}); a region must be a pure function of its arguments, so that "
                "it can be one op with a backward of its own.",
                "Return new tensors instead of writing into inputs (x = x + 1, not x.add_(1)), and keep "
                "logging and other Python side effects outside the region.",
            )
        finally:
            for i in dtensors:
                node = leaves[i].as_proxy().node
                node.meta["example_value"] = saved[node]
                leaves[i].synchronize_attributes(tx)

        operands = list(p_args[1:])
        in_texts, grad_texts = [], []
        for proxy in operands:
            value = proxy.node.meta["example_value"]
            if proxy.node in placement_of:
                in_texts.append(placement_of[proxy.node][0])
                grad_texts.append(placement_of[proxy.node][1])
            elif isinstance(value, DTensor):
                _refuse(
                    "local_map region that closes over a DTensor",
                    f"the region {name} uses the DTensor {proxy.node.name} without taking it as an argument, "
                    "so it has no declared placements and would not be unwrapped to its local shard.",
                    "Pass it as an argument of the region and give its in_placements.",
                )
            else:
                in_texts.append(None)
                grad_texts.append(None)

        out_leaves: list[VariableTracker] = []
        _flatten(body_r, out_leaves)
        checked_spec(
            "local_map region whose outputs do not match out_placements",
            len(out_leaves),
        )
        out_texts = []
        for vt in output_vts:
            index = next(k for k, leaf in enumerate(out_leaves) if leaf is vt)
            out_texts.append(spec.out_placements[index])
        try:
            check_output_kinds(
                name, [leaf.is_tensor() for leaf in out_leaves], spec.out_placements
            )
        except LocalMapError as e:
            _refuse(
                "local_map output that does not match out_placements",
                str(e),
                _fix_hint(str(e)),
            )
        spec = spec._replace(
            in_placements=tuple(in_texts),
            in_grad_placements=tuple(grad_texts),
            out_placements=tuple(out_texts),
        )
        result = _call_function_with_auto_output_flattening(
            tx,
            self.value,
            (p_args[0], str(spec), *operands),
            {},
            example_value,
            body_r,
            output_vts,
        )
        self._outputs_as_dtensors(tx, output_vts, spec, mesh)
        return result

    @staticmethod
    def _outputs_as_dtensors(
        tx: Any, output_vts: Sequence[VariableTracker], spec: Any, mesh: Any
    ) -> None:
        from torch.distributed.tensor import DTensor

        from hops.local_map import parse_placements

        hop_node = None
        wrapped = []
        for vt, text in zip(output_vts, spec.out_placements):
            node = vt.as_proxy().node
            hop_node = node.args[0] if node.target is operator.getitem else hop_node
            with tx.fake_mode:
                global_value = DTensor.from_local(
                    node.meta["example_value"],
                    mesh,
                    parse_placements(text),
                    run_check=False,
                )
            node.meta["example_value"] = global_value
            wrapped.append(global_value)
            vt.synchronize_attributes(tx)
        if hop_node is not None:
            hop_node.meta["example_value"] = tuple(wrapped)
            # Named after the region, as its AOT nodes are: reports say "from attention".
            hop_node._rename(spec.name)


def _fix_hint(message: str) -> str:
    """The fix is the message's last clause (after the ';')."""
    return message.rsplit("; ", 1)[-1]


def _handler(builder: Any, value: Any) -> VariableTracker:
    from torch._dynamo.guards import GuardBuilder

    from hops.local_map import local_map_region

    builder.install_guards(GuardBuilder.CLOSURE_MATCH)
    return LocalMapVariable(local_map_region, source=builder.source)


def ID_HANDLERS() -> dict[Callable[..., Any], Any]:
    from hops.local_map import _local_map_call

    return {_local_map_call: _handler}
