"""dtcompile.testing: each helper passes on a correct program and fails, readably, on a changed one."""

from __future__ import annotations

import importlib.metadata
import threading
import time

import expecttest
import pytest
import torch
import torch.distributed as dist
from expecttest import assert_expected_inline
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from dtcompile.testing import (
    RankFailure,
    assert_matches_eager,
    assert_no_graph_breaks,
    assert_no_recompiles,
    collective_schedule,
    fake_world,
    simulated_world,
    threaded_world,
)


class _MLP(nn.Module):
    def __init__(self, dim: int = 16, hidden: int = 32, gather_output: bool = False) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        self.gather_output = gather_output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x).relu()
        if self.gather_output:  # the deliberate change: a needless all-gather
            h = DTensor.from_local(h, self.up.weight.device_mesh, [Shard(1)], run_check=False)
            h = h.redistribute(placements=[Replicate()]).to_local()[:, : h.shape[1] // h.device_mesh.size()]
        return self.down(h)


def _tp_mlp(mesh, gather_output: bool = False) -> nn.Module:
    plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
    return parallelize_module(_MLP(gather_output=gather_output), mesh, plan)


TP_MLP_SCHEDULE = """\
forward 0/0:
  all_reduce            tp     x4    float32[4, 16]  256 B
backward 0/0: (no collectives)
forward total: 1 collectives, 256 B per rank
backward total: 0 collectives, 0 B per rank"""


def test_plugin_is_registered_and_fixtures_enter_worlds(fake_world):
    entry_points = importlib.metadata.entry_points(group="pytest11")
    assert "dtcompile_tools.pytest_plugin" in {ep.value for ep in entry_points}
    mesh = fake_world(8, (2, 4), ("dp", "tp"))
    assert dist.get_world_size() == 8 and mesh.mesh_dim_names == ("dp", "tp")
    assert mesh["tp"].size() == 4


def test_collective_schedule_snapshot(fake_world):
    mesh = fake_world(4, (4,), ("tp",))
    schedule = collective_schedule(_tp_mlp(mesh), torch.randn(4, 16))
    assert_expected_inline(str(schedule), TP_MLP_SCHEDULE)
    (reduce,) = schedule.forward
    assert (reduce.op, reduce.axis, reduce.group_size, reduce.bytes) == ("all_reduce", "tp", 4, 256)


@pytest.mark.skipif(expecttest.ACCEPT, reason="would rewrite the snapshot it checks fails")
def test_collective_schedule_snapshot_diff_shows_a_new_all_gather(fake_world):
    mesh = fake_world(4, (4,), ("tp",))
    changed = collective_schedule(_tp_mlp(mesh, gather_output=True), torch.randn(4, 16))
    with pytest.raises(AssertionError) as err:
        assert_expected_inline(str(changed), TP_MLP_SCHEDULE)
    diff = str(err.value)
    assert "+  all_gather            tp     x4    float32[16, 8]  512 B" in diff
    assert "-forward total: 1 collectives, 256 B per rank" in diff


def test_collective_schedule_wants_a_dtcompile_backend(fake_world):
    mesh = fake_world(4, (4,), ("tp",))
    with pytest.raises(TypeError, match="backend must be 'dtcompile' or a dtcompile.backend"):
        collective_schedule(_tp_mlp(mesh), torch.randn(4, 16), backend="inductor")


def test_collective_schedule_on_a_backend_whose_records_are_full(fake_world):
    """The backend keeps its newest records only (a bounded deque): once it holds
    as many as it keeps, the schedule must still be this call's graphs."""
    import dtcompile

    mesh = fake_world(4, (4,), ("tp",))
    backend = dtcompile.backend(inductor=False)
    collective_schedule(_tp_mlp(mesh), torch.randn(4, 16), backend=backend)
    backend.records.extend([backend.records[-1]] * backend.records.maxlen)
    assert len(backend.records) == backend.records.maxlen
    schedule = collective_schedule(_tp_mlp(mesh), torch.randn(4, 16), backend=backend)
    assert_expected_inline(str(schedule), TP_MLP_SCHEDULE)


def test_fake_world_checks_the_mesh_shape():
    with pytest.raises(ValueError, match=r"mesh_shape \(2, 3\) has 6 ranks but world_size is 8"), fake_world(8, (2, 3)):
        pass
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match=r"mesh_dim_names \('tp',\) has 1 names for a 2-D mesh_shape"), fake_world(8, (2, 4), ("tp",)):
        pass


# ---------------------------------------------------------------- assert_matches_eager


def _redistribute(d: DTensor) -> torch.Tensor:
    return d.redistribute(placements=[Replicate()]).to_local() * 2


def test_matches_eager_on_every_simulated_rank():
    with simulated_world(4, (4,), ("tp",)) as mesh:
        d = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)], src_data_rank=None).requires_grad_()
        assert_matches_eager(_redistribute, d)


class _Skewed(nn.Module):
    """Compiled on rank 2, the ``b`` branch is scaled: its gradient and the output differ there."""

    def __init__(self, mesh) -> None:
        super().__init__()
        self.a = nn.Parameter(DTensor.from_local(torch.ones(4), mesh, [Replicate()], run_check=False))
        self.b = nn.Parameter(DTensor.from_local(torch.full((4,), 2.0), mesh, [Replicate()], run_check=False))

    def forward(self, x: DTensor) -> DTensor:
        skew = 1.5 if torch.compiler.is_compiling() and dist.get_rank() == 2 else 1.0
        return x * self.a + x * self.b * skew


def test_wrong_gradient_names_the_rank_and_the_parameter():
    def build(mesh):
        x = DTensor.from_local(torch.arange(4.0), mesh, [Replicate()], run_check=False)
        return _Skewed(mesh), (x,)

    with pytest.raises(AssertionError) as err:
        assert_matches_eager(build, world=threaded_world(4, (4,), ("tp",)))
    message = str(err.value)
    assert message.startswith("compiled does not match eager: 2 mismatch(es)\n")
    lines = message.splitlines()[1:]
    assert [line.split(":")[0] for line in lines] == ["rank 2, output", "rank 2, grad of b"]
    assert "Mismatched elements: 3 / 4" in lines[1]


class _DoubledWhenCompiling(nn.Module):
    def forward(self, x: DTensor) -> DTensor:
        return x * (2.0 if torch.compiler.is_compiling() else 1.0)


def test_threaded_eager_steps_end_before_any_rank_compiles():
    """``is_compiling()`` is one flag per process: rank 1's eager step, run while
    rank 0 compiles, would read True and take the compiled branch.  Here rank 1
    starts late and rank 0's compile holds the flag a while; every rank's eager
    step must still see 1x, so every rank's compiled 2x is a mismatch."""
    rank0_compiling = threading.Event()

    def slow_backend(gm, example_inputs):
        if dist.get_rank() == 0:
            rank0_compiling.set()
            time.sleep(0.5)
        return gm.forward

    def build(mesh):
        if dist.get_rank() == 1:
            # Without the wait between eager and compile, rank 0 is compiling now.
            rank0_compiling.wait(timeout=2.0)
        return _DoubledWhenCompiling(), (DTensor.from_local(torch.ones(4), mesh, [Replicate()], run_check=False),)

    with pytest.raises(AssertionError) as err:
        assert_matches_eager(build, world=threaded_world(2), backward=False, backend=slow_backend)
    lines = str(err.value).splitlines()[1:]
    assert [line.split(":")[0] for line in lines] == ["rank 0, output", "rank 1, output"]


def test_matches_eager_refuses_args_with_a_threaded_world():
    with pytest.raises(TypeError, match=r"pass a builder fn\(mesh\) -> \(fn_or_module, args\)"):
        assert_matches_eager(_redistribute, torch.ones(1), world=threaded_world(2))


def _build_returning_a_bare_tensor(mesh):
    x = DTensor.from_local(torch.ones(8, 4), mesh, [Replicate()], run_check=False)
    return _DoubledWhenCompiling(), x  # should be (module, (x,))


def test_matches_eager_names_a_builder_that_returns_the_wrong_shape():
    with pytest.raises(RankFailure) as err:
        assert_matches_eager(_build_returning_a_bare_tensor, world=threaded_world(2))
    message = str(err.value)
    assert message.startswith("run_threaded: rank(s) [0, 1] failed\n")
    assert (
        "TypeError: assert_matches_eager: the builder test_testing._build_returning_a_bare_tensor "
        "returned (_DoubledWhenCompiling, DTensor); it must return (fn_or_module, args) with args "
        "a tuple of fn's arguments, e.g. `return model, (x,)`"
    ) in message
    assert "positional argument" not in message


def _two_views(x: DTensor) -> tuple[DTensor, DTensor]:
    y = x * x
    return y.squeeze(1), y.permute(2, 1, 0)


def test_matches_eager_refuses_a_graph_that_ran_eagerly(fake_world):
    """Stock AOTAutograd refuses two outputs that view one DTensor result, so dtcompile
    runs the graph eagerly (``eager_fallback``): compiled would equal eager trivially."""
    mesh = fake_world(2)
    x = DTensor.from_local(torch.ones(3, 1, 4), mesh, [Replicate()], run_check=False).requires_grad_()
    with pytest.raises(AssertionError) as err, pytest.warns(UserWarning, match="it runs eagerly instead"):
        assert_matches_eager(_two_views, x)
    assert str(err.value).startswith(
        "assert_matches_eager: dtcompile ran 1 graph(s) eagerly, so the comparison would prove nothing: "
        "compile 0/0: torch's AOTAutograd could not trace this graph over DTensor"
    )


# ---------------------------------------------------------------- graph breaks and recompiles


def test_no_graph_breaks_passes_and_fails_with_the_reason(fake_world):
    mesh = fake_world(4, (4,), ("tp",))
    d = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)], src_data_rank=None)
    with assert_no_graph_breaks():
        torch.compile(_redistribute, backend="aot_eager")(d)

    def broken(d):
        torch._dynamo.graph_break()
        return d * 2

    with pytest.raises(AssertionError) as err, assert_no_graph_breaks():
        torch.compile(broken, backend="aot_eager")(d)
    assert str(err.value).startswith("1 graph break(s):\n- ")
    assert "graph_break" in str(err.value)


def test_no_recompiles_fails_with_the_placement_difference(fake_world):
    mesh = fake_world(4, (4,), ("tp",))
    compiled = torch.compile(_redistribute, backend="aot_eager", fullgraph=True)
    sharded = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)], src_data_rank=None)
    compiled(sharded)
    with assert_no_recompiles():
        compiled(distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)], src_data_rank=None))
    with pytest.raises(AssertionError) as err, assert_no_recompiles():
        compiled(distribute_tensor(torch.randn(8, 4), mesh, [Replicate()], src_data_rank=None))
    message = str(err.value)
    assert message.startswith("1 recompile(s):\n- _redistribute (")
    assert message.endswith("0/0: placements of arg d changed: (Shard(dim=0),) -> (Replicate(),)")
