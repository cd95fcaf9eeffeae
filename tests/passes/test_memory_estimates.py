"""The passes' memory estimates kept while a graph is unchanged (#70): asked again of the same
graph, :class:`~dtcompile.graph.memory.Estimates` answers the kept estimate without a walk;
after any change an estimate reads (order, inputs, values, nodes, target) or for another
``held_bytes`` or kind, it answers a fresh one, equal to :func:`estimate_memory`'s."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from dtcompile.base.channels import GraphKind
from dtcompile.graph import memory
from dtcompile.graph.memory import Estimates, estimate_memory

aten = torch.ops.aten


def _graph() -> fx.GraphModule:
    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        u, v = x * 2.0, w * 3.0
        b = torch.relu(torch.mm(u, v))
        c = torch.cat([b, b], dim=1)
        return torch.sum(c * 2.0)

    mode = FakeTensorMode()
    with mode:
        x, w = torch.empty(64, 32), torch.empty(32, 128)
    return make_fx(f)(x, w)


def _node(gm: fx.GraphModule, target: object) -> fx.Node:
    return next(n for n in gm.graph.nodes if n.target is target)


def _reorder(gm: fx.GraphModule) -> None:
    # The two independent scalings swapped: the same nodes, in another order.
    u, v = [n for n in gm.graph.nodes if n.target is aten.mul.Tensor][:2]
    u.prepend(v)


def _fake_like(gm: fx.GraphModule, shape: tuple[int, ...]) -> torch.Tensor:
    mode = next(n for n in gm.graph.nodes if n.op == "placeholder").meta["val"].fake_mode
    with mode:
        return torch.empty(shape)


def _last_mul(gm: fx.GraphModule) -> fx.Node:
    return [n for n in gm.graph.nodes if n.target is aten.mul.Tensor][-1]


def _new_input(gm: fx.GraphModule) -> None:
    mul = _last_mul(gm)
    relu = _node(gm, aten.relu.default)
    cat = _node(gm, aten.cat.default)
    mul.replace_input_with(cat, relu)
    mul.meta["val"] = _fake_like(gm, (64, 128))


def _new_value(gm: fx.GraphModule) -> None:
    cat = _node(gm, aten.cat.default)
    cat.meta["val"] = _fake_like(gm, (64, 4096))


def _new_node(gm: fx.GraphModule) -> None:
    relu = _node(gm, aten.relu.default)
    with gm.graph.inserting_after(relu):
        big = gm.graph.call_function(aten.clone.default, (relu,))
    big.meta["val"] = _fake_like(gm, (64, 128))
    gm.graph.output_node().prepend(gm.graph.call_function(aten.sum.default, (big,)))
    gm.graph.output_node().prev.meta["val"] = _fake_like(gm, ())


def _erased_node(gm: fx.GraphModule) -> None:
    mul = _last_mul(gm)
    cat = _node(gm, aten.cat.default)
    mul.replace_input_with(cat, _node(gm, aten.relu.default))
    mul.meta["val"] = _fake_like(gm, (64, 128))
    gm.graph.erase_node(cat)


def _new_target(gm: fx.GraphModule) -> None:
    _node(gm, aten.relu.default).target = aten.gelu.default


CHANGES: dict[str, Callable[[fx.GraphModule], None]] = {
    "order": _reorder, "input": _new_input, "value": _new_value, "node added": _new_node,
    "node erased": _erased_node, "target": _new_target,
}


@pytest.fixture
def walks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    counted: list[int] = []
    real = memory.estimate_memory

    def counting(*args: object, **kwargs: object) -> memory.MemoryEstimate:
        counted.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(memory, "estimate_memory", counting)
    return counted


def test_the_same_graph_gets_the_kept_estimate(walks: list[int]) -> None:
    gm = _graph()
    estimates = Estimates()
    first = estimates(gm, GraphKind.FORWARD, 100)
    assert estimates(gm, GraphKind.FORWARD, 100) is first
    assert estimates(gm.graph, GraphKind.FORWARD, 100) is first
    assert len(walks) == 1
    assert first == estimate_memory(gm, GraphKind.FORWARD, 100)


def test_another_held_bytes_or_kind_is_estimated_anew(walks: list[int]) -> None:
    gm = _graph()
    estimates = Estimates()
    forward = estimates(gm, GraphKind.FORWARD, 0)
    held = estimates(gm, GraphKind.FORWARD, 1 << 20)
    backward = estimates(gm, GraphKind.BACKWARD, 0)
    assert len(walks) == 3
    assert held.peak_bytes == forward.peak_bytes + (1 << 20)
    assert backward.kind == GraphKind.BACKWARD
    assert estimates(gm, GraphKind.FORWARD, 0) is forward and len(walks) == 3


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_changed_graph_is_estimated_anew(change: str, walks: list[int]) -> None:
    gm = _graph()
    estimates = Estimates()
    before = estimates(gm, GraphKind.FORWARD)
    CHANGES[change](gm)
    gm.graph.lint()
    after = estimates(gm, GraphKind.FORWARD)
    assert len(walks) == 2, change
    assert after == estimate_memory(gm, GraphKind.FORWARD)  # the module's own, not counted
    if change != "target":  # a target's change alone moves no byte
        assert (after.nodes, after.curve) != (before.nodes, before.curve), change
    assert estimates(gm, GraphKind.FORWARD) is after and len(walks) == 2
