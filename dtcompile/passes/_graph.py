"""Small graph helpers shared by the rewriting passes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from typing import Any

import torch
from torch import fx

from dtcompile.base.op_facts import WAIT

__all__ = [
    "PROVENANCE", "alias_roots", "first_use_index", "provenance", "read_inputs", "refresh_metadata", "replace_uses",
    "single_wait", "written_args",
]


PROVENANCE = ("from_node", "seq_nr", "autograd_backward", "custom", "stack_trace", "nn_module_stack", "fwd_nn_module_stack")
"""The node-meta fields a node a pass makes takes from the node it stands for: where the
value comes from (``from_node``, autograd's ``seq_nr``, whether it is backward work:
``autograd_backward``), the user's annotations (``custom``: graph_trainer's memory policy,
regional Inductor) and the user code (``stack_trace``, ``nn_module_stack``), as torch's own
bucketing gives its merged nodes (``_inductor/fx_passes/bucketing.py``). Passes after
dtcompile's (graph_trainer's remat, offload, regional Inductor; Inductor's own) read them."""


def provenance(node: fx.Node) -> dict[str, Any]:
    """The :data:`PROVENANCE` fields ``node`` has (a mutable one copied: the new nodes do not
    share it), for the nodes a pass makes in its place."""
    return {key: (dict(value) if isinstance(value, dict) else value)
            for key in PROVENANCE if (value := node.meta.get(key))}


def single_wait(collective: fx.Node) -> fx.Node | None:
    """The one ``wait_tensor`` that consumes a collective, or None (several users, or none)."""
    users = list(collective.users)
    if len(users) == 1 and users[0].target is WAIT:
        return users[0]
    return None


def replace_uses(replacements: Mapping[fx.Node, fx.Node], keep: Set[fx.Node] = frozenset()) -> None:
    """What ``old.replace_all_uses_with(new)`` does for each ``old: new`` of ``replacements``,
    each reader's arguments rewritten once.  torch's rewrites a reader's arguments whole for
    each node it replaces there, and a fused optimizer's node reads every gradient: a
    bucket's members replaced one by one cost the bucket's size times the node's.  The
    readers in ``keep`` are left as they are (the caller rewrites them later)."""
    def swap(node: fx.Node) -> fx.Node:
        return replacements.get(node, node)

    readers = dict.fromkeys(reader for old in replacements for reader in old.users if reader not in keep)
    hooks = next(iter(replacements)).graph.owning_module if replacements else None
    hooks = getattr(hooks, "_replace_hooks", None) or ()
    for reader in readers:
        for old in reader.all_input_nodes:
            if old in replacements:
                for hook in hooks:  # as replace_all_uses_with calls them
                    hook(old=old, new=replacements[old].name, user=reader)
        reader.args = fx.map_arg(reader.args, swap)
        kwargs = fx.map_arg(reader.kwargs, swap)
        if kwargs != reader.kwargs:
            reader.kwargs = kwargs


def first_use_index(node: fx.Node, index: dict[fx.Node, int]) -> int:
    """Position of the first node that uses ``node`` (the end of the graph if none)."""
    return min((index[u] for u in node.users), default=len(index))


def refresh_metadata(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> None:
    """Give every node without ``meta["val"]`` (the ones a pass made) its fake value.

    Each such node's target runs on its inputs' fake values in the graph's fake
    mode, in graph order; a layout op of :data:`_META_EXACT` on static inputs runs as its
    meta kernel (:func:`_on_meta`).  (Not ``FakeTensorProp``: its interpreter touches
    ``torch.fx.traceback`` globals, which ranks-as-threads share while another
    rank traces its backward.)
    """
    from torch._guards import detect_fake_mode

    mode = detect_fake_mode(example_inputs) or detect_fake_mode(
        [n.meta.get("val") for n in gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]
    )
    if mode is None:
        raise AssertionError("refresh_metadata: the graph has no fake values to start from")

    def value(arg: Any) -> Any:
        return arg.meta["val"] if isinstance(arg, fx.Node) else arg

    with mode:
        for node in gm.graph.nodes:
            if node.op != "call_function" or "val" in node.meta:
                continue
            args = torch.utils._pytree.tree_map(value, node.args)
            kwargs = torch.utils._pytree.tree_map(value, node.kwargs)
            if node.target in _META_EXACT and _static((args, kwargs)):
                node.meta["val"] = _on_meta(mode, node.target, args, kwargs)
            else:
                node.meta["val"] = node.target(*args, **kwargs)


_aten = torch.ops.aten
_META_EXACT = frozenset({
    _aten.reshape.default, _aten.view.default, _aten.slice.Tensor, _aten.split.Tensor,
    _aten.split_with_sizes.default, _aten.cat.default, _aten.permute.default, _aten.t.default,
})
"""The layout ops the passes make (bucketing's slices and reshapes; async-TP's splits), whose
fake value is their meta kernel's output on the inputs' meta tensors: torch's own C++ shape
arithmetic, without the fake mode's Python dispatch (its cache, its Python decompositions:
about 1.4 ms a node against 0.1 ms)."""


def _static(args: Any) -> bool:
    """Whether every tensor in ``args`` is a fake tensor of static sizes, strides and offset, and no
    argument is a symbolic size (stricter than :func:`dtcompile.base.sizes.is_symbolic`, which reads sizes only)."""
    from torch._subclasses.fake_tensor import FakeTensor

    for leaf in torch.utils._pytree.tree_leaves(args):
        if isinstance(leaf, torch.SymInt):
            return False
        if isinstance(leaf, torch.Tensor):
            if not isinstance(leaf, FakeTensor):
                return False
            if any(isinstance(d, torch.SymInt) for d in (*leaf.shape, *leaf.stride(), leaf.storage_offset())):
                return False
    return True


def _on_meta(mode: Any, target: Any, args: Any, kwargs: Any) -> Any:
    """``target``'s output on the fake inputs run as meta tensors (torch's C++ meta kernels),
    each output wrapped as a fake tensor on the inputs' device (a view keeps its input's
    storage), as the fake mode's own dispatch wraps a meta kernel's outputs."""
    from torch._subclasses.fake_tensor import in_kernel_invocation_manager

    device = next(t for t in torch.utils._pytree.tree_leaves(args) if isinstance(t, torch.Tensor)).fake_device
    # Without the Python dispatcher (AOTAutograd's compile enables it): the C++ meta kernels,
    # not their Python references (``torch._refs.view``'s, about twice the time).
    with in_kernel_invocation_manager(mode), torch._C._DisablePythonDispatcher():
        out = target(*args, **kwargs)
    return torch.utils._pytree.tree_map_only(
        torch.Tensor, lambda t: mode.fake_tensor_converter.from_meta_and_device(mode, t, device), out
    )


def alias_roots(graph: fx.Graph) -> dict[fx.Node, fx.Node]:
    """Every node -> the node whose storage it shares: itself, or for a view (an op
    whose schema says its output aliases its first argument, ``t``, ``view``, an
    in-place op's result) the root of that argument."""
    roots: dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        roots[node] = node
        schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
        first = node.args[0] if node.args else None
        if schema is None or not isinstance(first, fx.Node) or len(schema.returns) != 1:
            continue
        if schema.returns[0].alias_info is not None:
            roots[node] = roots.get(first, first)
    return roots


def written_args(node: fx.Node) -> list[fx.Node]:
    """The nodes ``node`` writes in place (its schema's mutable arguments; lists flattened)."""
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    if schema is None:
        return []
    written = []
    for arg, value in zip(schema.arguments, node.args):
        if arg.alias_info is not None and arg.alias_info.is_write:
            written.extend(v for v in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(v, fx.Node))
    return written


def read_inputs(node: fx.Node) -> list[fx.Node]:
    """The values ``node`` reads, for ordering it against in-place writes: its inputs, and
    for a ``wait_tensor`` its collective's inputs too (a collective runs, reading its
    input, until its wait returns: gloo's and NCCL's in the background)."""
    inputs = list(node.all_input_nodes)
    if node.target is WAIT:
        for collective in node.all_input_nodes:
            inputs.extend(collective.all_input_nodes)
    return inputs
