"""The Dynamo graph's outputs that AOTAutograd cannot return as the user's program does.

Two kinds are taken out of a Dynamo graph before AOTAutograd traces it and put
back around the compiled result:

- :func:`split_constant_outputs`: Python objects the graph returns as
  constants (a placement made inside the compiled code), which AOTAutograd
  would return as its trace-time fakes;
- :func:`split_input_views`: outputs that are views of a DTensor input, which
  AOTAutograd would regenerate with ``as_strided`` (refused by DTensor, or with
  the wrong placement on a degenerate shard); each is computed at run time by
  its own view ops on the real input.

:func:`with_outputs_put_back` wraps the compiled function so that its outputs
are the user's again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import fx

from dtcompile.base.op_facts import VIEW_FUNCTIONS, VIEW_METHODS

__all__ = ["split_constant_outputs", "split_input_views", "with_outputs_put_back"]


def split_constant_outputs(gm: fx.GraphModule) -> dict[int, Any]:
    """Takes the Python objects a Dynamo graph returns as constants out of its outputs.

    A placement made inside the compiled code (``Shard(1)``, or the placements
    of a DTensor built by a factory) is a constant in the graph's output tuple.
    AOTAutograd traces with fake objects and would return its fake
    (``FakeScriptObject``) in the real one's place; the graph returns ``None``
    there instead and :func:`with_outputs_put_back` puts the real object back.
    """
    (output,) = (node for node in gm.graph.nodes if node.op == "output")
    values = output.args[0]
    if not isinstance(values, (tuple, list)):
        return {}
    constants = {i: v for i, v in enumerate(values) if v is not None and not isinstance(v, fx.Node)}
    if constants:
        output.args = (type(values)(None if i in constants else v for i, v in enumerate(values)),)
        gm.recompile()
    return constants


def split_input_views(gm: fx.GraphModule) -> dict[int, tuple[tuple[int, ...], fx.GraphModule]]:
    """Takes the outputs that are views of a DTensor input out of a Dynamo graph.

    AOTAutograd regenerates an output that aliases an input from the input at
    run time, with ``as_strided`` for a DTensor, which DTensor refuses ("as_strided
    not supported with DTensor") or, on a degenerate shard, gets the placement
    wrong.  Such an output is instead computed at run time by its own view ops on
    the real input (eager's view, eager's placement, eager's aliasing): returns
    output index -> (the placeholders it reads, a graph of its view chain).
    """
    from torch.distributed.tensor import DTensor
    from torch.multiprocessing.reductions import StorageWeakRef

    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    storages = {}
    for node in placeholders:
        value = node.meta.get("example_value")
        if isinstance(value, DTensor):
            storages[StorageWeakRef(value._local_tensor.untyped_storage())] = node
    (output,) = (node for node in gm.graph.nodes if node.op == "output")
    values = output.args[0]
    if not storages or not isinstance(values, (tuple, list)):
        return {}
    views = {}
    for i, node in enumerate(values):
        value = node.meta.get("example_value") if isinstance(node, fx.Node) else None
        if node is None or node.op == "placeholder" or not isinstance(value, DTensor):
            continue
        if StorageWeakRef(value._local_tensor.untyped_storage()) not in storages and not _views_an_input(node):
            continue
        views[i] = _view_chain(gm, node, placeholders)
    if views:
        output.args = (type(values)(None if i in views else v for i, v in enumerate(values)),)
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return views


def _views_an_input(node: fx.Node) -> bool:
    """Whether ``node`` is made from a placeholder by view and shape ops alone."""
    while node.op != "placeholder":
        if not (
            (node.op == "call_method" and node.target in VIEW_METHODS)
            or (node.op == "call_function" and node.target in VIEW_FUNCTIONS)
        ):
            return False
        source = node.args[0] if node.args else None
        if not isinstance(source, fx.Node):
            return False
        node = source
    return True


def _view_chain(gm: fx.GraphModule, out: fx.Node, placeholders: list[fx.Node]) -> tuple[tuple[int, ...], fx.GraphModule]:
    needed, stack = set(), [out]
    while stack:
        node = stack.pop()
        if node not in needed:
            needed.add(node)
            stack.extend(node.all_input_nodes)
    graph, env = fx.Graph(), {}
    reads = []
    for node in gm.graph.nodes:
        if node not in needed:
            continue
        if node.op == "placeholder":
            reads.append(placeholders.index(node))
            env[node] = graph.placeholder(node.name)
        else:
            env[node] = graph.node_copy(node, lambda a: env[a])
    graph.output(env[out])
    return tuple(reads), fx.GraphModule(gm, graph)


def with_outputs_put_back(
    compiled: Callable[..., Any],
    constants: dict[int, Any],
    views: dict[int, tuple[tuple[int, ...], fx.GraphModule]],
) -> Callable[..., Any]:
    """``compiled`` with the outputs :func:`split_constant_outputs` and
    :func:`split_input_views` took out back in place."""
    if not constants and not views:
        return compiled

    def put_back(made: dict[int, Any], outputs: Sequence[Any]) -> list[Any]:
        outputs = list(outputs)
        for i, value in [*constants.items(), *made.items()]:
            outputs[i] = value
        return outputs

    # Dynamo calls a backend's result with the graph's inputs as positional
    # arguments (AOTAutograd's result carries a ``_boxed_call`` flag it copied
    # from an inner function; Dynamo does not read it).
    def run(*args: Any) -> list[Any]:
        made = {i: chain(*(args[j] for j in reads)) for i, (reads, chain) in views.items()}
        return put_back(made, compiled(*args))

    return run
