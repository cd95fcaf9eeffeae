"""Ordering barriers: what communicates in a way dtcompile does not know, and what no pass moves across.

:func:`dtcompile.base.op_facts.is_ordering_barrier` on hand-built graphs (each family of op
it decides on), and the ``overlap`` pass keeping the traced order of communication: a
collective is never issued before another collective or a barrier, compute never moves
across a barrier.  The whole path, on gloo ranks with Inductor, is
``tests/e2e/test_communication_order.py``.
"""

from __future__ import annotations

import operator

import torch
from support import comm_ops  # noqa: F401 - defines the commorder ops
from torch import fx

import dtcompile
import dtcompile.base.fused_ops  # noqa: F401 - defines the dtcompile fused ops
from dtcompile._testing.cases import pass_context
from dtcompile.base.op_facts import WAIT, is_ordering_barrier
from dtcompile.passes.overlap import reorder_for_overlap

_c10d = torch.ops._c10d_functional
_commorder = torch.ops.commorder
_higher_order = torch.ops.higher_order


def _body(barrier: bool) -> fx.GraphModule:
    """A subgraph of one op: a custom send (a barrier) or a multiply."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    if barrier:
        graph.output(graph.call_function(_commorder.send.default, (x, 1)))
    else:
        graph.output(graph.call_function(torch.ops.aten.mul.Tensor, (x, 2)))
    return fx.GraphModule(torch.nn.Module(), graph)


def test_what_is_an_ordering_barrier():
    root = torch.nn.Module()
    root.talks, root.quiet = _body(True), _body(False)
    graph = fx.Graph()
    x, token, pred = graph.placeholder("x"), graph.placeholder("token"), graph.placeholder("pred")
    talks, quiet = graph.get_attr("talks"), graph.get_attr("quiet")
    calls = {
        # communicates, and dtcompile does not know it
        "custom_send_with_effects": (_higher_order.with_effects, (token, _commorder.send.default, x, 1)),
        "custom_gather_effectful_bare": (_commorder.all_gather.default, (x,)),  # a make_fx graph's
        "custom_mutating_bare": (_commorder.scale_.default, (x,)),
        "custom_mutating_functionalized": (_higher_order.auto_functionalized_v2, (_commorder.scale_.default,)),
        "c10d_barrier": (torch.ops.c10d.barrier.default, (x, None, [], 0)),
        "functional_irecv": (_c10d.irecv.default, (x, 0, 0, "0")),
        "functional_isend": (_c10d.isend.default, (x, 1, 0, "0")),
        "functional_all_reduce_in_place": (_c10d.all_reduce_.default, (x, "sum", "0")),
        "dtensor_alltoall": (torch.ops._dtensor.shard_dim_alltoall.default, (x, 0, 1, "0")),
        "cond_over_a_send": (_higher_order.cond, (pred, talks, quiet, (x,))),
        # computes on this rank, or is a collective or wait dtcompile knows
        "aten_mul": (torch.ops.aten.mul.Tensor, (x, 2)),
        "aten_print_with_effects": (_higher_order.with_effects, (token, torch.ops.aten._print.default, "hi")),
        "custom_pure": (_commorder.double.default, (x,)),
        "functional_all_gather": (_c10d.all_gather_into_tensor.default, (x, 2, "0")),
        "functional_wait": (_c10d.wait_tensor.default, (x,)),
        "fused_all_gather_matmul": (torch.ops.dtcompile.fused_all_gather_matmul.default, (x, [x], 0, "0")),
        "cond_over_a_multiply": (_higher_order.cond, (pred, quiet, quiet, (x,))),
        "python_function": (operator.add, (x, x)),
    }
    nodes = {name: graph.call_function(target, args, name=name) for name, (target, args) in calls.items()}
    graph.output(tuple(nodes.values()))
    fx.GraphModule(root, graph)  # the owning module: where a cond's bodies are
    barriers = [name for name, node in nodes.items() if is_ordering_barrier(node)]
    assert barriers == list(calls)[: list(calls).index("aten_mul")], barriers
    assert not is_ordering_barrier(x)


def _graph(build) -> fx.GraphModule:
    """The graph ``build(graph, x, y, token)`` writes (values of 8 floats), with fake values."""
    graph = fx.Graph()
    x, y, token = graph.placeholder("x"), graph.placeholder("y"), graph.placeholder("token")
    graph.output(build(graph, x, y, token))
    with torch._subclasses.FakeTensorMode():
        for node in graph.nodes:
            if node.op == "placeholder":
                node.meta["val"] = torch.empty(0 if node is token else 8)
            elif node.op == "call_function":
                args = [a.meta["val"] if isinstance(a, fx.Node) else a for a in node.args]
                node.meta["val"] = node.target(*args)
    return fx.GraphModule(torch.nn.Module(), graph)


def _reorder(gm: fx.GraphModule) -> tuple[list[str], list[str]]:
    ctx = pass_context(dtcompile.DTCompileConfig(inductor=False))
    gm = reorder_for_overlap(gm, [], ctx)
    return [n.name for n in gm.graph.nodes if n.op == "call_function"], [str(o) for o in ctx.outcomes]


def test_overlap_issues_no_collective_before_the_one_traced_before_it(fake_world):
    """all_reduce(x * 2), its wait, compute on it, then all_reduce(y) of an input: the second is
    issued right after the first (under its window), never before it."""
    fake_world(4)

    def build(graph, x, y, token):
        aten = torch.ops.aten
        doubled = graph.call_function(aten.mul.Tensor, (x, 2))
        first = graph.call_function(_c10d.all_reduce.default, (doubled, "sum", "0"))
        done = graph.call_function(aten.add.Tensor, (graph.call_function(WAIT, (first,)), 1))
        second = graph.call_function(_c10d.all_reduce.default, (y, "sum", "0"))
        return done, graph.call_function(aten.mul.Tensor, (graph.call_function(WAIT, (second,)), 3))

    order, outcomes = _reorder(_graph(build))
    # Before, the second all-reduce went to the top, above the first.
    assert order == ["mul_tensor", "all_reduce_default", "all_reduce_default_1", "wait_tensor_default",
                     "add_tensor", "wait_tensor_default_1", "mul_tensor_1"], order
    assert "all_reduce_default_1: issued 2 node(s) earlier, after all_reduce_default" in outcomes, outcomes


def test_overlap_moves_no_collective_nor_compute_across_a_barrier(fake_world):
    """y * 3, a custom send (with_effects), x * 2, all_reduce(x * 2): the all-reduce stays after
    the send, and neither the send nor the compute before it moves under the all-reduce."""
    fake_world(4)

    def build(graph, x, y, token):
        early = graph.call_function(torch.ops.aten.mul.Tensor, (y, 3))
        sent = graph.call_function(_higher_order.with_effects, (token, _commorder.send.default, y, 1))
        tokens = [graph.call_function(operator.getitem, (sent, i)) for i in range(2)]
        doubled = graph.call_function(torch.ops.aten.mul.Tensor, (x, 2))
        reduced = graph.call_function(_c10d.all_reduce.default, (doubled, "sum", "0"))
        waited = graph.call_function(_c10d.wait_tensor.default, (reduced,))
        return graph.call_function(torch.ops.aten.add.Tensor, (waited, early)), *tokens

    order, outcomes = _reorder(_graph(build))
    assert order.index("with_effects") < order.index("all_reduce_default"), order
    assert order.index("mul_tensor") < order.index("with_effects"), order
    assert not [o for o in outcomes if "moved after it" in o or "earlier" in o], outcomes
