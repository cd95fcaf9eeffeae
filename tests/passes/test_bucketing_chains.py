"""Bucketing where one bucket reduces the results of another.

A gradient replicated on two mesh axes whose contributions are ``Partial`` on
both is all-reduced once per axis (DTensor warns: two sequential all-reduces),
so the all-reduces over the second axis read the first ones' results: once the
first bucket is rewritten, they read its slices instead.  The MoE's norm and
router gradients on a ``(dp, ep)`` mesh are such a chain (tests/e2e/test_moe.py).
"""

from __future__ import annotations

import torch
from torch import fx

import dtcompile
from dtcompile._testing.cases import pass_context
from dtcompile.passes.bucketing import bucket_collectives
from dtcompile.records import Action

c10d = torch.ops._c10d_functional


def _chained_all_reduces(first: str, second: str) -> fx.GraphModule:
    """x and y each all-reduced over ``first``, then the results over ``second``."""
    graph = fx.Graph()
    inputs = [graph.placeholder("x"), graph.placeholder("y")]
    once = [graph.call_function(c10d.wait_tensor.default, (graph.call_function(c10d.all_reduce.default, (t, "sum", first)),)) for t in inputs]
    twice = [graph.call_function(c10d.wait_tensor.default, (graph.call_function(c10d.all_reduce.default, (t, "sum", second)),)) for t in once]
    graph.output(tuple(twice))
    with torch._subclasses.FakeTensorMode():
        shapes = iter([(4, 2), (3,)])
        for node in graph.nodes:
            if node.op == "placeholder":
                node.meta["val"] = torch.empty(next(shapes))
            elif node.op == "call_function":
                node.meta["val"] = node.target(*[a.meta["val"] if isinstance(a, fx.Node) else a for a in node.args])
    return fx.GraphModule(torch.nn.Module(), graph)


def test_a_bucket_of_the_results_of_another_bucket(fake_world):
    mesh = fake_world(4, (2, 2), ("dp", "ep"))
    ep, dp = (mesh[axis].get_group().group_name for axis in ("ep", "dp"))
    config = dtcompile.DTCompileConfig(inductor=False, memory_budget_bytes=1 << 40)  # memory out of the way
    ctx = pass_context(config, "backward")
    gm = bucket_collectives(_chained_all_reduces(ep, dp), [], ctx)
    assert [o.text for o in ctx.outcomes if o.action is Action.BUCKETED] == [
        "all_reduce[2 -> 1]: all_reduce_default, all_reduce_default_1 (44 B)",
        "all_reduce[2 -> 1]: all_reduce_default_2, all_reduce_default_3 (44 B)",
    ]
    reduces = [n for n in gm.graph.nodes if n.target is c10d.all_reduce.default]
    assert [n.args[2] for n in reduces] == [ep, dp]
    # The second bucket is issued after the first one's wait, and reads its slices.
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    (first_wait,) = reduces[0].users
    assert order[first_wait] < order[reduces[1]]
    # The fake group reduces nothing: each output is its own input, in its own shape.
    x, y = torch.arange(8.0).reshape(4, 2), torch.tensor([10.0, 11.0, 12.0])
    out_x, out_y = gm(x, y)
    torch.testing.assert_close(out_x, x, rtol=0, atol=0)
    torch.testing.assert_close(out_y, y, rtol=0, atol=0)
