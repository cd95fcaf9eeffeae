"""Dynamic shapes: dtcompile never specializes a symbolic size, so it compiles
exactly as often as stock AOTAutograd on the same sequence of batch sizes.

Costs, byte counts and reports read sizes through :mod:`dtcompile.base.sizes`
(hints, no guards); ``int()`` on a batch size once added a guard per size.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import dtcompile
from dtcompile._testing import models
from dtcompile.testing import fake_world

SIZES = [8, 16, 4, 16, 8, 5]
DYNAMIC_SIZES = list(range(2, 22, 2))


def _frame_count(build, backend, dynamic, sizes) -> int:
    torch._dynamo.reset()
    with fake_world(2) as mesh:
        _, model, example = build(mesh)
        counter = CompileCounterWithBackend(backend)
        step = torch.compile(model, backend=counter, dynamic=dynamic)
        for batch in sizes:
            step(torch.randn(batch, *example.shape[1:])).sum().backward()
    return counter.frame_count


@pytest.mark.parametrize(
    "build",
    [models.build_mlp, models.build_fsdp_mlp, pytest.param(models.build_block, marks=pytest.mark.models)],
    ids=lambda b: b.__name__,
)
@pytest.mark.parametrize(("dynamic", "sizes"), [(None, SIZES), (True, DYNAMIC_SIZES)], ids=["automatic", "dynamic"])
def test_compiles_as_often_as_stock_aot_eager(build, dynamic, sizes):
    stock = _frame_count(build, "aot_eager", dynamic, sizes)
    ours = _frame_count(build, dtcompile.backend(inductor=False), dynamic, sizes)
    assert ours == stock, f"dtcompile compiled {ours} times, stock aot_eager {stock}, for batch sizes {sizes}"
    # Not a vacuous equality: automatic dynamic compiles a static then a dynamic graph.
    assert stock == (2 if dynamic is None else 1) or build is models.build_block


def test_has_unbacked_answers_as_torchs_walk_of_every_size_static_backed_and_unbacked():
    """``dtcompile.base.sizes.has_unbacked`` (a collective's ``data_dependent``) skips torch's
    walk of each size's expression where no size is symbolic (#70: the walk was most of
    describing a static graph's collectives); where one is, it answers as that walk does."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv, free_unbacked_symbols

    from dtcompile.base.sizes import has_unbacked

    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)
    static = mode.from_tensor(torch.empty(4, 8), static_shapes=True)
    backed = mode.from_tensor(torch.empty(4, 8))
    assert any(isinstance(s, torch.SymInt) for s in backed.shape), "the test no longer makes a symbolic size"
    with mode:
        u = env.create_unbacked_symint()
        unbacked = torch.empty(u, 8)
        offset = torch.empty(64)[u:]  # an unbacked storage offset (and size)
        transposed = unbacked.t()
    cases = {
        "static": ([static, 3, "x"], False),
        "backed": ([backed, static], False),
        "unbacked tensor": ([static, unbacked], True),
        "unbacked int": ([[static], (u,)], True),
        "unbacked offset": ([{"x": offset}], True),
        "unbacked transposed": ([transposed], True),
        "nothing": ([None, 1.5], False),
    }
    for name, (values, want) in cases.items():
        leaves = [v for v in torch.utils._pytree.tree_leaves(values) if isinstance(v, (torch.Tensor, torch.SymInt))]
        assert bool(free_unbacked_symbols(leaves)) == want, name  # the cases are what they say
        assert has_unbacked(*values) == want, name
