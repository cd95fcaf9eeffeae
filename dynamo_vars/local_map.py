"""``dtcompile.hops.local_map`` in compiled code: one ``local_map_region`` node per call.

Stock Dynamo inlines ``local_map`` (the region and its placements are gone
before a backend sees them), and its own local_map HOP, off by default,
asserts on DTensor inputs, wants ``None`` placements last and the mesh given.
Here a call to a function made by :func:`dtcompile.hops.local_map` becomes:

1. the call's arguments read by name (:class:`dtcompile.hops.local_map.LocalMapCall`)
   and its placements checked against its flat arguments (the same checks,
   and messages, as eager: :func:`dtcompile.hops.local_map.make_spec`);
2. DTensor arguments redistributed in the graph when ``redistribute_inputs=True``;
3. the region traced as a subgraph at local shapes: for the trace, each
   DTensor argument's example value is its local shard; closures over plain
   tensors are lifted as operands; side effects are refused;
4. one ``local_map_region(body, spec, *operands)`` node, whose
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
from dataclasses import dataclass
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

from dtcompile.base.notation import real_object
from dtcompile.base.torch_compat import fake_tensor_call_errors, variable_getattr

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


@dataclass
class _Call:
    """What one traced ``local_map`` call knows, filled in step by step by :class:`LocalMapVariable`."""

    func: VariableTracker
    """The user's region function."""
    name: str
    mesh: Any
    out_placements: Any
    in_placements: Any
    in_grad_placements: Any
    redistribute: bool
    leaves: list[VariableTracker]
    """The flat user arguments (pytree order), DTensors redistributed where asked."""
    values: list[Any]
    """Their example values (DTensors, fake tensors) or constants."""
    rebuild: Callable[[list[VariableTracker]], VariableTracker]
    """Rebuilds the user's argument structure from ``leaves``."""
    spec: Any = None
    """The :class:`~hops.RegionSpec` of the call, as checked by ``make_spec``."""

    @property
    def dtensors(self) -> list[int]:
        from torch.distributed.tensor import DTensor

        return [i for i, v in enumerate(self.values) if isinstance(v, DTensor)]

    def checked_spec(self, what: str, num_outputs: int | None) -> Any:
        """The eager checks and messages (``make_spec``), as a refusal that names ``what``."""
        from dtcompile.hops.local_map import make_spec
        from dtcompile.hops.spec import LocalMapError

        try:
            return make_spec(
                self.name,
                self.mesh,
                self.values,
                self.in_placements,
                self.in_grad_placements,
                self.out_placements,
                num_outputs,
                self.redistribute,
            )
        except LocalMapError as e:
            _refuse(what, str(e), _fix_hint(str(e)))


class LocalMapVariable(WrapHigherOrderVariable):
    """A call ``local_map(func, ...)(*args)``: see the module docstring.

    The call's own arguments come first, in the order of
    :class:`dtcompile.hops.local_map.LocalMapCall` (read by field name), then the user's.
    """

    supports_input_mutation = False
    supports_aliasing = False

    def call_function(
        self,
        tx: Any,
        args: Sequence[VariableTracker],
        kwargs: dict[str, VariableTracker],
    ) -> VariableTracker:
        from dtcompile.hops.local_map import LocalMapCall

        declared = LocalMapCall(*args[: len(LocalMapCall._fields)])
        user_args = list(args[len(LocalMapCall._fields) :])
        call = self._read_call(declared, user_args)
        if not call.dtensors:
            # Eager local_map calls func as it is when no argument is a DTensor.
            return declared.func.call_function(tx, user_args, kwargs)
        if _constant(declared.check_placements):
            _refuse(
                "local_map(check_placements=True) in a compiled region",
                "check_placements compares each output across all simulated ranks; that needs the values, "
                "so the call runs eagerly.",
                "Drop check_placements once the region is checked, or check it in an eager test run.",
            )
        call.spec = call.checked_spec("local_map arguments that do not match its placements", None)
        placement_of = self._redistribute_inputs(tx, call)
        self._copy_repeated_arguments(tx, call, placement_of)
        p_args, example_value, body_r, output_vts = self._trace_body(tx, call, kwargs)
        operands = list(p_args[1:])
        spec = self._final_spec(call, operands, placement_of, body_r, output_vts)
        result = _call_function_with_auto_output_flattening(
            tx,
            self.value,
            (p_args[0], str(spec), *operands),
            {},
            example_value,
            body_r,
            output_vts,
        )
        self._outputs_as_dtensors(tx, output_vts, spec, call.mesh)
        return result

    @staticmethod
    def _read_call(declared: Any, user_args: list[VariableTracker]) -> _Call:
        """Step 1: the call's constants, and the user's arguments flattened as pytree does."""
        from dtcompile.hops.local_map import region_name

        leaves: list[VariableTracker] = []
        rebuild = _flatten(TupleVariable(list(user_args)), leaves)
        values = [_example(vt) for vt in leaves]
        func = declared.func
        call = _Call(
            func=func,
            name=region_name(getattr(func, "fn", None) or getattr(func, "get_function", lambda: func)()),
            mesh=None,
            out_placements=_constant(declared.out_placements),
            in_placements=_constant(declared.in_placements),
            in_grad_placements=_constant(declared.in_grad_placements),
            redistribute=_constant(declared.redistribute_inputs),
            leaves=leaves,
            values=values,
            rebuild=rebuild,
        )
        mesh = _constant(declared.device_mesh)
        if mesh is not None:
            call.mesh = real_object(mesh)
        elif call.dtensors:
            call.mesh = real_object(values[call.dtensors[0]].device_mesh)
        return call

    @staticmethod
    def _redistribute_inputs(tx: Any, call: _Call) -> dict[Any, tuple[Any, Any]]:
        """Step 2: DTensor arguments redistributed in the graph where asked; returns each
        tensor argument's node -> (its in placements, its gradient placements)."""
        from dtcompile.hops.spec import format_placements, parse_placements

        tensor_leaves = [i for i, v in enumerate(call.values) if isinstance(v, torch.Tensor)]
        by_leaf = dict(zip(tensor_leaves, zip(call.spec.in_placements, call.spec.in_grad_placements)))
        for i in call.dtensors:
            want = by_leaf[i][0]
            if want is not None and format_placements(call.values[i].placements) != want:
                # Placements are constants to Dynamo (opaque value types): the call
                # is traced as the user's own x.redistribute(placements=...) would be.
                call.leaves[i] = call.leaves[i].call_method(
                    tx,
                    "redistribute",
                    [],
                    {"placements": VariableTracker.build(tx, parse_placements(want))},
                )
                call.values[i] = call.leaves[i].as_proxy().node.meta["example_value"]
        return {call.leaves[i].as_proxy().node: by_leaf[i] for i in tensor_leaves}

    def _trace_body(
        self, tx: Any, call: _Call, kwargs: dict[str, VariableTracker]
    ) -> tuple[Any, Any, VariableTracker, Sequence[VariableTracker]]:
        """Step 3: the region traced as a subgraph, each DTensor argument seen as its local shard."""
        saved = {}
        for i in call.dtensors:
            node = call.leaves[i].as_proxy().node
            saved[node] = node.meta["example_value"]
            node.meta["example_value"] = _local_fake(tx, call.values[i])
            call.leaves[i].synchronize_attributes(tx)
        user_args = list(call.rebuild(call.leaves).items)
        try:
            (p_args, _, example_value, body_r, _, _, output_vts, _) = self.create_wrapped_node(
                tx,
                call.func,
                user_args,
                kwargs,
                "local_map",
                subgraph_name="local_map_body",
                set_subgraph_inputs="automatic_with_forced_inputs",
            )
        except Unsupported as e:
            if not any(word in str(e) for word in ("side effect", "mutation")):
                _refuse(
                    "local_map region that Dynamo cannot trace",
                    f"local_map {call.name}: {_first_line(e)}. The region is one op or nothing: without "
                    "fullgraph=True the whole call runs eagerly (this graph break), the code around it compiled.",
                    "Keep print, data-dependent Python control flow and other untraceable code out of the "
                    "region, or accept that it runs eagerly.",
                )
            _refuse(
                "side effect inside a local_map region",
                f"local_map {call.name}: the region mutates one of its inputs or Python state outside it "
                f"({_first_line(e)}); a region must be a pure function of its arguments, so that "
                "it can be one op with a backward of its own.",
                "Return new tensors instead of writing into inputs (x = x + 1, not x.add_(1)), and keep "
                "logging and other Python side effects outside the region.",
            )
        except fake_tensor_call_errors() as e:
            if "mixed torch.Tensor and DTensor" not in str(e):
                raise
            _refuse_closed_over_dtensor(call.name, "")
        finally:
            for i in call.dtensors:
                node = call.leaves[i].as_proxy().node
                node.meta["example_value"] = saved[node]
                call.leaves[i].synchronize_attributes(tx)
        return p_args, example_value, body_r, output_vts

    @staticmethod
    def _copy_repeated_arguments(tx: Any, call: _Call, placement_of: dict[Any, tuple[Any, Any]]) -> None:
        """A tensor given to the region twice (``region(x, x)``) is copied for its second
        place: a HOP's operands must not alias each other.  Same values, one copy more.

        A DTensor's copy is its local shard's, wrapped with the same mesh, placements, shape
        and stride: ``clone`` would go through DTensor's sharding propagation, which may
        choose other placements (``Partial('avg')`` comes back ``Replicate``).  Its
        gradient passes through as the region returns it, in the declared
        ``in_grad_placements``, local values and all: by default ``to_local`` and
        ``from_local`` would make a ``Partial`` gradient ``Replicate`` (an all-reduce), the
        same sum, but other per-rank values than eager's.
        """
        from torch.distributed.tensor import DTensor

        from dtcompile.hops.spec import parse_placements

        seen = set()
        for i, (leaf, value) in enumerate(zip(call.leaves, call.values)):
            if not isinstance(value, torch.Tensor):
                continue
            node = leaf.as_proxy().node
            if node in seen:
                if isinstance(value, DTensor):
                    declared_grad = placement_of[node][1]
                    grads = (
                        variable_getattr(leaf, tx, "placements")
                        if declared_grad is None
                        else VariableTracker.build(tx, parse_placements(declared_grad))
                    )
                    local = leaf.call_method(tx, "to_local", [], {"grad_placements": grads}).call_method(tx, "clone", [], {})
                    copy = VariableTracker.build(tx, DTensor.from_local).call_function(
                        tx,
                        [local, variable_getattr(leaf, tx, "device_mesh"), variable_getattr(leaf, tx, "placements")],
                        {
                            "run_check": VariableTracker.build(tx, False),
                            "shape": leaf.call_method(tx, "size", [], {}),
                            "stride": leaf.call_method(tx, "stride", [], {}),
                            "grad_placements": grads,
                        },
                    )
                else:
                    copy = leaf.call_method(tx, "clone", [], {})
                call.leaves[i] = copy
                call.values[i] = copy.as_proxy().node.meta["example_value"]
                placement_of[copy.as_proxy().node] = placement_of[node]
            seen.add(node)

    @staticmethod
    def _final_spec(
        call: _Call,
        operands: Sequence[Any],
        placement_of: dict[Any, tuple[Any, Any]],
        body_r: VariableTracker,
        output_vts: Sequence[VariableTracker],
    ) -> Any:
        """Step 4: the spec of the traced region: one entry per operand (lifted closures
        included, without placements) and per output, checked against ``out_placements``."""
        from torch.distributed.tensor import DTensor

        from dtcompile.hops.region_op import check_output_kinds
        from dtcompile.hops.spec import LocalMapError

        in_texts, grad_texts = [], []
        for proxy in operands:
            value = proxy.node.meta["example_value"]
            if proxy.node in placement_of:
                in_texts.append(placement_of[proxy.node][0])
                grad_texts.append(placement_of[proxy.node][1])
            elif isinstance(value, DTensor):
                _refuse_closed_over_dtensor(call.name, f" {proxy.node.name}")
            else:
                in_texts.append(None)
                grad_texts.append(None)

        out_leaves: list[VariableTracker] = []
        _flatten(body_r, out_leaves)
        call.checked_spec("local_map region whose outputs do not match out_placements", len(out_leaves))
        out_texts = []
        for vt in output_vts:
            index = next(k for k, leaf in enumerate(out_leaves) if leaf is vt)
            out_texts.append(call.spec.out_placements[index])
        try:
            check_output_kinds(call.name, [leaf.is_tensor() for leaf in out_leaves], call.spec.out_placements)
        except LocalMapError as e:
            _refuse("local_map output that does not match out_placements", str(e), _fix_hint(str(e)))
        return call.spec._replace(
            in_placements=tuple(in_texts),
            in_grad_placements=tuple(grad_texts),
            out_placements=tuple(out_texts),
        )

    @staticmethod
    def _outputs_as_dtensors(
        tx: Any, output_vts: Sequence[VariableTracker], spec: Any, mesh: Any
    ) -> None:
        """Step 5: the region's outputs, DTensors placed per ``out_placements``."""
        from torch.distributed.tensor import DTensor

        from dtcompile.hops.spec import parse_placements

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


def _refuse_closed_over_dtensor(region: str, name: str) -> None:
    _refuse(
        "local_map region that closes over a DTensor",
        f"the region {region} uses the DTensor{name} without taking it as an argument, so it has no "
        "declared placements and is not unwrapped to its local shard: inside the region it meets local "
        "tensors (DTensor's \"mixed torch.Tensor and DTensor\").",
        "Pass it as an argument of the region and give its in_placements (for a weight: Replicate() or "
        "its Shard), or close over its local shard (w.to_local()) if that is what the region means.",
    )


def _first_line(error: Exception) -> str:
    """An Unsupported's reason: its first line, or its explanation when the first is only the gb_type."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    explanation = next((line.removeprefix("Explanation: ") for line in lines if line.startswith("Explanation:")), None)
    return (explanation or (lines[0] if lines else type(error).__name__)).rstrip(".")


def _fix_hint(message: str) -> str:
    """The fix is the message's last clause (after the ';')."""
    return message.rsplit("; ", 1)[-1]


def _handler(builder: Any, value: Any) -> VariableTracker:
    from torch._dynamo.guards import GuardBuilder

    from dtcompile.hops.region_op import local_map_region

    builder.install_guards(GuardBuilder.CLOSURE_MATCH)
    return LocalMapVariable(local_map_region, source=builder.source)


def ID_HANDLERS() -> dict[Callable[..., Any], Any]:
    from dtcompile.hops.local_map import _local_map_call

    return {_local_map_call: _handler}
