"""Small graph helpers shared by the rewriting passes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import fx

__all__ = ["first_use_index", "refresh_metadata", "single_wait"]

_WAIT = torch.ops._c10d_functional.wait_tensor.default


def single_wait(collective: fx.Node) -> fx.Node | None:
    """The one ``wait_tensor`` that consumes a collective, or None (several users, or none)."""
    users = list(collective.users)
    if len(users) == 1 and users[0].target is _WAIT:
        return users[0]
    return None


def first_use_index(node: fx.Node, index: dict[fx.Node, int]) -> int:
    """Position of the first node that uses ``node`` (the end of the graph if none)."""
    return min((index[u] for u in node.users), default=len(index))


def refresh_metadata(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> None:
    """Give every node without ``meta["val"]`` (the ones a pass made) its fake value.

    Each such node's target runs on its inputs' fake values in the graph's fake
    mode, in graph order.  (Not ``FakeTensorProp``: its interpreter touches
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
            node.meta["val"] = node.target(*args, **kwargs)
