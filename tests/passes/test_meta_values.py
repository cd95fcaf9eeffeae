"""The fake values ``refresh_metadata`` gives the layout nodes a pass makes (#70): read off
the meta kernels, they are what the fake mode's own dispatch gives, views sharing their
input's storage; symbolic inputs take the fake mode's dispatch."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from dtcompile.passes import _graph
from dtcompile.passes._graph import refresh_metadata

aten = torch.ops.aten


def _cases(a: torch.Tensor, b: torch.Tensor) -> list[tuple[object, tuple, dict]]:
    """Each op of ``_META_EXACT`` on the [6, 40] ``a`` and the [6, 24] ``b``, views of views
    and non-contiguous inputs among them."""
    at = a[:, 4:28]
    return [
        (aten.reshape.default, (a, [240]), {}),
        (aten.reshape.default, (at, [144]), {}),  # a copy: the columns are not contiguous
        (aten.reshape.default, (a[:1, 8:20], [3, 4]), {}),  # one row: a view
        (aten.view.default, (a, [12, 20]), {}),
        (aten.slice.Tensor, (a, 1, 8, 31), {}),
        (aten.slice.Tensor, (at, 0, 2, 5), {}),
        (aten.split.Tensor, (a, 16, 1), {}),
        (aten.split_with_sizes.default, (b, [10, 14], 1), {}),
        (aten.cat.default, ([a, b], 1), {}),
        (aten.cat.default, ([at, b],), {"dim": 0}),
        (aten.permute.default, (a, [1, 0]), {}),
        (aten.t.default, (b,), {}),
    ]


def _facts(value: object, inputs: list[torch.Tensor]) -> object:
    if isinstance(value, (list, tuple)):
        return [_facts(v, inputs) for v in value]
    assert isinstance(value, FakeTensor)
    shares = [value.untyped_storage()._cdata == t.untyped_storage()._cdata for t in inputs]
    return (tuple(value.shape), value.stride(), value.storage_offset(), value.dtype, value.device,
            value.fake_mode, shares)


@pytest.mark.parametrize("python_dispatcher", [False, True], ids=["plain", "python-dispatcher"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_meta_values_are_the_fake_modes_own(dtype: torch.dtype, python_dispatcher: bool) -> None:
    """Also under the Python dispatcher, as AOTAutograd's compile runs the passes: the fake
    mode's own values come from torch's Python references there, the fast path's from the
    C++ meta kernels."""
    from torch._dispatch.python import enable_python_dispatcher

    mode = FakeTensorMode(shape_env=ShapeEnv())
    with enable_python_dispatcher() if python_dispatcher else contextlib.nullcontext(), mode:
        a, b = torch.empty(6, 40, dtype=dtype), torch.empty(6, 24, dtype=dtype)
        for target, args, kwargs in _cases(a, b):
            assert target in _graph._META_EXACT
            assert _graph._static(args)
            fast = _graph._on_meta(mode, target, args, kwargs)
            stock = target(*args, **kwargs)
            assert _facts(fast, [a, b]) == _facts(stock, [a, b]), target


def test_every_fast_op_has_a_case() -> None:
    with FakeTensorMode():
        covered = {target for target, _, _ in _cases(torch.empty(6, 40), torch.empty(6, 24))}
    assert covered == _graph._META_EXACT


def test_refresh_metadata_gives_the_nodes_a_pass_made_their_values(monkeypatch: pytest.MonkeyPatch) -> None:
    ran = []
    on_meta = _graph._on_meta
    monkeypatch.setattr(_graph, "_on_meta", lambda *a: ran.append(a[1]) or on_meta(*a))
    mode = FakeTensorMode(shape_env=ShapeEnv())
    with mode:
        flat = torch.empty(2, 64)
    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = flat
    piece = graph.call_function(aten.slice.Tensor, (x, 1, 16, 40))
    back = graph.call_function(aten.reshape.default, (piece, [48]))
    graph.output(back)
    refresh_metadata(fx.GraphModule(torch.nn.Module(), graph), [flat])
    assert ran == [aten.slice.Tensor, aten.reshape.default]
    assert _facts(piece.meta["val"], [flat]) == (
        (2, 24), (64, 1), 16, torch.float32, torch.device("cpu"), mode, [True])
    # the columns are not contiguous in two rows: reshape copies
    assert _facts(back.meta["val"], [flat]) == ((48,), (1,), 0, torch.float32, torch.device("cpu"), mode, [False])


def test_symbolic_inputs_take_the_fake_modes_dispatch() -> None:
    shape_env = ShapeEnv()
    mode = FakeTensorMode(shape_env=shape_env)
    with mode:
        dynamic = torch.empty(shape_env.create_unbacked_symint(), 4)
    assert isinstance(dynamic.shape[0], torch.SymInt)
    assert not _graph._static((dynamic, 1, 0, 2))
    assert not _graph._static((torch.empty(3), [3]))  # a real tensor
    with mode:
        assert _graph._static(([torch.empty(2, 2), torch.empty(2, 2)], 0))
