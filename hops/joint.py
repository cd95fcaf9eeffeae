"""A region's forward and backward: traced together once, partitioned, cached per compile.

:func:`joint_graphs` traces the region's joint forward + backward with
autograd (the region may hold ops, like funcol's collectives, whose autograd
formulas functorch cannot transform), functionalizes it, and splits it with
the default partitioner into a forward graph (outputs, then what the backward
saves) and a backward graph (saved values and output gradients in, input
gradients out).  Inside :func:`dtcompile.hops.keep_regions` (one dtcompile compile) the
result is cached per (body structure, spec, operand metadata), so N identical layers
trace their region once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from dtcompile.hops.spec import RegionSpec

__all__ = ["Joint", "call_body", "joint_graphs"]


def call_body(body: Callable[..., Any], operands: Sequence[Any]) -> tuple[Any, ...]:
    out = body(*operands)
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


class Joint(NamedTuple):
    forward: torch.fx.GraphModule
    backward: torch.fx.GraphModule
    forward_spec: RegionSpec
    backward_spec: RegionSpec
    num_outputs: int
    grad_outputs: tuple[int, ...]
    """Indices of the outputs that get a gradient (the backward's tangents, in order)."""
    grad_inputs: tuple[int, ...]
    """Indices of the operands that get one (the backward returns these, in order)."""


def _trace_joint(
    body: Callable[..., Any], spec: RegionSpec | str, operands: Sequence[Any]
) -> Joint:
    """Traces the region's forward and backward together and partitions them.

    The forward returns the outputs and then what the backward saves; the backward
    takes the saved values and the outputs' gradients and returns the inputs'.
    """
    spec = RegionSpec.of(spec)
    from torch._dispatch.python import suspend_functionalization
    from torch._functorch.partitioners import default_partition
    from torch._guards import detect_fake_mode
    from torch._inductor.compile_fx import select_decomp_table
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch._subclasses.functional_tensor import disable_functional_mode
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing, make_fx

    with (
        suspend_functionalization(),
        disable_functional_mode(),
        disable_proxy_modes_tracing(),
    ):
        fake_mode = detect_fake_mode(operands) or FakeTensorMode(
            allow_non_fake_inputs=True
        )
        with fake_mode, torch.enable_grad():
            # Non-tensor operands (the sizes Dynamo lifts under dynamic shapes) pass as they are.
            primals = [
                torch.empty_strided(
                    x.shape,
                    x.stride(),
                    dtype=x.dtype,
                    device=x.device,
                    requires_grad=x.requires_grad,
                )
                if isinstance(x, torch.Tensor)
                else x
                for x in operands
            ]
            outs = call_body(body, primals)
        grad_inputs = tuple(
            i for i, x in enumerate(primals) if isinstance(x, torch.Tensor) and x.requires_grad
        )
        grad_outputs = tuple(
            i
            for i, y in enumerate(outs)
            if isinstance(y, torch.Tensor) and y.requires_grad
        )
        with fake_mode:
            tangents = [
                torch.empty_like(outs[i], requires_grad=False) for i in grad_outputs
            ]
            primals = [_detach(p) for p in primals]

        num_primals, num_outputs = len(primals), len(outs)

        def joint(*primals_and_tangents: torch.Tensor) -> tuple[torch.Tensor, ...]:
            inputs = primals_and_tangents[:num_primals]
            with torch.enable_grad():
                outs = call_body(body, inputs)
                grads = torch.autograd.grad(
                    [outs[i] for i in grad_outputs],
                    [inputs[i] for i in grad_inputs],
                    list(primals_and_tangents[num_primals:]),
                    allow_unused=True,
                )
            grads = tuple(
                g if g is not None else torch.zeros_like(inputs[i])
                for g, i in zip(grads, grad_inputs)
            )
            return (*outs, *grads)

        # Traced with autograd (the region may hold ops, like funcol's collectives,
        # whose autograd formulas functorch cannot transform), then functionalized.
        with fake_mode:
            for i in grad_inputs:
                primals[i].requires_grad_(True)
            traced = make_fx(joint, decomposition_table=select_decomp_table())(
                *primals, *tangents
            )
            primals = [_detach(p) for p in primals]
            joint_gm = make_fx(
                torch.func.functionalize(traced, remove="mutations_and_views")
            )(*primals, *tangents)
        _prepare_for_partition(joint_gm, num_primals, num_outputs)
        forward, backward = default_partition(joint_gm, [], num_fwd_outputs=num_outputs)
        _save_in_backward_order(forward, backward, num_outputs)

    num_saved = len(forward.graph.find_nodes(op="output")[0].args[0]) - num_outputs
    forward_spec = spec._replace(saved=num_saved)
    backward_spec = spec._replace(
        backward=True,
        saved=num_saved,
        in_placements=tuple(spec.out_placements[i] for i in grad_outputs),
        out_placements=tuple(spec.in_grad_placements[i] for i in grad_inputs),
    )
    return Joint(
        forward,
        backward,
        forward_spec,
        backward_spec,
        num_outputs,
        grad_outputs,
        grad_inputs,
    )


def _save_in_backward_order(
    forward: torch.fx.GraphModule, backward: torch.fx.GraphModule, num_outputs: int
) -> None:
    """Reorders what ``forward`` saves to the order of ``backward``'s inputs.

    The partitioner returns saved tensors before saved sizes (SymInts, under
    dynamic shapes) but the backward takes the sizes first; the region's
    backward call passes the saved values in the order the forward returned them.
    """
    output = forward.graph.find_nodes(op="output")[0]
    results, saved = output.args[0][:num_outputs], output.args[0][num_outputs:]
    by_name = {node.name: node for node in saved}
    wanted = [node.name for node in backward.graph.find_nodes(op="placeholder")[: len(saved)]]
    if sorted(wanted) != sorted(by_name):
        raise AssertionError(f"region backward reads {wanted} but its forward saves {sorted(by_name)}")
    output.args = ((*results, *(by_name[name] for name in wanted)),)
    forward.recompile()


def _detach(x: Any) -> Any:
    return x.detach() if isinstance(x, torch.Tensor) else x


def _prepare_for_partition(
    gm: torch.fx.GraphModule, num_primals: int, num_outputs: int
) -> None:
    """Names placeholders ``primals_i``/``tangents_i`` and tags what the outputs need as
    forward: the partitioner reads both (an untagged node counts as backward and is
    recomputed there)."""
    for i, node in enumerate(gm.graph.find_nodes(op="placeholder")):
        node.name = node.target = (
            f"primals_{i + 1}" if i < num_primals else f"tangents_{i - num_primals + 1}"
        )
    for node in gm.graph.nodes:
        # A region under activation checkpointing is saved or recomputed as one op by the
        # outer graph; tags that leaked into its own joint would split it wrongly.
        for key in ("recompute", "ac_graph_id", "partitioner_tag"):
            node.meta.pop(key, None)
    outputs = gm.graph.find_nodes(op="output")[0].args[0][:num_outputs]
    needed = set()
    stack = [n for n in outputs if isinstance(n, torch.fx.Node)]
    while stack:
        node = stack.pop()
        if node in needed:
            continue
        needed.add(node)
        stack.extend(node.all_input_nodes)
    # The partitioner cuts after the last forward node: move the forward ahead of
    # anything the tangents feed (it depends on primals only, so order is kept).
    anchor = gm.graph.find_nodes(op="placeholder")[-1]
    for node in list(gm.graph.nodes):
        if node in needed and node.op == "call_function":
            node.meta["partitioner_tag"] = "is_forward"
            anchor.append(node)
            anchor = node
    gm.recompile()




def _operand_key(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        # str(): sizes may be SymInts (dynamic shapes), which do not hash.
        return ("tensor", str(tuple(x.shape)), str(x.stride()), x.dtype, x.device, x.requires_grad)
    return ("value", str(x))


def _structure(body: torch.fx.GraphModule) -> tuple[Any, ...]:
    """The body's graph up to names: each node's op, target and arguments (nodes by position).

    Dynamo names a body's placeholders after the caller's variables (``l_ws_0_``,
    ``l_ws_1_``), so identical layers differ by name only; this key does not.
    """
    index: dict[torch.fx.Node, int] = {}

    def arg(a: Any) -> Any:
        return ("node", index[a]) if isinstance(a, torch.fx.Node) else repr(a)

    nodes = []
    for i, node in enumerate(body.graph.nodes):
        index[node] = i
        nodes.append(
            (
                node.op,
                "" if node.op == "placeholder" else str(node.target),
                torch.fx.node.map_aggregate(node.args, arg),
                torch.fx.node.map_aggregate(dict(node.kwargs), arg),
            )
        )
    return tuple(repr(n) for n in nodes)


def joint_graphs(
    body: Callable[..., Any],
    spec: RegionSpec | str,
    operands: Sequence[Any],
    cache: dict[Any, Joint] | None = None,
) -> Joint:
    """The region's partitioned forward and backward (see the module docstring).

    With a ``cache`` (the one :func:`dtcompile.hops.keep_regions` opens per compile) a
    body that is a traced ``GraphModule`` is looked up by its structure, the spec
    and the operands' metadata: identical layers share one trace.  A plain
    Python body is traced each call (its code says nothing of its closure).
    """
    if cache is None or not isinstance(body, torch.fx.GraphModule):
        return _trace_joint(body, spec, operands)
    key = (_structure(body), str(spec), tuple(_operand_key(x) for x in operands))
    joint = cache.get(key)
    if joint is None:
        joint = cache[key] = _trace_joint(body, spec, operands)
    return joint
