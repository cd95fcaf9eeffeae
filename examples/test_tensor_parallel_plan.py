"""An example to copy: test a tensor-parallel plan in CI, on one CPU process.

Run with ``python -m pytest examples/test_tensor_parallel_plan.py``.  The
``fake_world`` fixture comes from dtcompile's pytest plugin, installed with
dtcompile; the rest from ``dtcompile.testing``.

Three tests a parallelism plan wants:
1. the communication it does is the one you expect (a snapshot: a change that
   adds an all-gather shows up as a diff);
2. compiled gives the same numbers as eager, on every rank;
3. it compiles as one graph and does not recompile from step to step.
"""

import torch
from expecttest import assert_expected_inline
from torch import nn
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

import dtcompile
from dtcompile.testing import (
    assert_matches_eager,
    assert_no_graph_breaks,
    assert_no_recompiles,
    collective_schedule,
    threaded_world,
)


class FeedForward(nn.Module):
    def __init__(self, dim: int = 32, hidden: int = 64) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, dim)
        # Every rank builds the same weights.  A generator, not torch.manual_seed:
        # with threaded_world the ranks are threads sharing the global RNG.
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)

    def forward(self, x):
        return self.w2(torch.nn.functional.gelu(self.w1(x)))


PLAN = {"w1": ColwiseParallel(), "w2": RowwiseParallel()}


def build(mesh):
    """The parallel model and this rank's input: what every test below starts from."""
    model = parallelize_module(FeedForward(), mesh, PLAN)
    return model, (torch.randn(8, 32, generator=torch.Generator().manual_seed(1)),)


def test_communication_is_one_all_reduce_forward(fake_world):
    mesh = fake_world(4, (4,), ("tp",))  # rank 0 of 4; collectives move no data
    model, args = build(mesh)
    assert_expected_inline(
        str(collective_schedule(model, *args)),
        """\
forward 0/0:
  all_reduce            tp     x4    float32[8, 32]  1024 B
backward 0/0: (no collectives)
forward total: 1 collectives, 1024 B per rank
backward total: 0 collectives, 0 B per rank""",
    )


def test_compiled_matches_eager_on_every_rank():
    # 4 ranks as threads, real collectives; each rank compiles its own program.
    assert_matches_eager(build, world=threaded_world(4, (4,), ("tp",)), backend=dtcompile.backend(inductor=False))


def test_one_graph_and_no_recompiles(fake_world):
    mesh = fake_world(4, (4,), ("tp",))
    model, (x,) = build(mesh)
    compiled = torch.compile(model, backend=dtcompile.backend(inductor=False))
    with assert_no_graph_breaks():
        compiled(x).sum().backward()
    with assert_no_recompiles():
        for _ in range(3):
            compiled(torch.randn(8, 32)).sum().backward()
