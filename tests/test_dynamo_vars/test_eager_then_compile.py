"""A DTensor model run eagerly on rank threads, then DTensor code compiled in the same process: one frame.

torch notes whether a dispatch mode is active in three flags of the process
(``torch.utils._python_dispatch``), which each mode saves as it is entered and
restores as it exits.  Rank threads of :func:`dtcompile.testing.run_threaded`
running eager DTensor code enter modes at the same time (DTensor shards an op
that has no sharding rule, here ``index_add`` in ``index_select``'s backward,
through its decomposition under a ``PlacementTrackingMode``), restore each
other's values, and left the flags set after the world.  The next mode the
main thread entered (a simulated world's ``LocalTensorMode``) passed them on
to Dynamo's guards, which then saw the mode's dispatch keys on every tensor
that tracing had not: each compiled frame failed its own guards on its first
call and compiled again, for the same mesh and placements ("runtime guards
failed even though they passed during recompilation-reason analysis"), and
the recompiled model marked its sizes dynamic and failed to trace.  Users who
run a model eagerly on threaded ranks and compile in the same process (a test
suite) got both.  ``run_threaded`` now puts the flags back as the calling
thread had them.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import guard_failures
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
from torch.utils import _python_dispatch
from torch.utils._python_dispatch import TorchDispatchMode

import dtcompile
from dtcompile._testing.idioms import IDIOMS, check_idiom
from dtcompile.testing import run_threaded, simulated_world

BACKEND = dtcompile.backend(inductor=False)


def _dispatch_mode_flags() -> tuple[bool, bool, bool]:
    return (
        _python_dispatch._is_in_torch_dispatch_mode,
        _python_dispatch._is_in_non_infra_torch_dispatch_mode,
        _python_dispatch._is_in_any_mode_without_ignore_compile_internals,
    )


class Permuted(nn.Module):
    """A column-parallel projection whose output features are read in reverse order.

    ``index_select`` on a DTensor: its backward (``index_add``) has no sharding
    rule in DTensor, which shards it through its decomposition under a dispatch mode.
    """

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.register_buffer("order", torch.arange(15, -1, -1))

    def forward(self, x: torch.Tensor) -> DTensor:
        y = self.proj(x)
        order = DTensor.from_local(self.order, y.device_mesh, [Replicate()], run_check=False)
        return y.index_select(-1, order)


def _parallel(mesh) -> nn.Module:
    torch.manual_seed(0)
    plan = {"proj": ColwiseParallel(output_layouts=Replicate(), use_local_output=False)}
    return parallelize_module(Permuted(), mesh, plan)


def _eager_steps(rank: int) -> None:
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    model = _parallel(mesh)
    # Each batch size is a new op for DTensor's sharding caches: every rank shards
    # index_add through its decomposition again, the ranks at about the same time.
    for batch in range(1, 9):
        model(torch.randn(batch, 16)).to_local().pow(2).sum().backward()


def _run_eagerly_on_rank_threads() -> None:
    run_threaded(4, _eager_steps)


class _SeesCompileInternals(TorchDispatchMode):
    """A mode like DTensor's ``PlacementTrackingMode``: not an infra mode, does not ignore compile internals."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _enter_and_exit_interleaved(rank: int, turns: threading.Barrier) -> None:
    """Rank 0 enters, rank 1 enters, rank 0 exits, rank 1 exits: each exit restores
    what that rank saw on entry, so the last leaves the flags set."""
    mode = _SeesCompileInternals()
    for turn in range(2):
        if rank == turn:
            mode.__enter__()
        turns.wait()
    for turn in range(2):
        if rank == turn:
            mode.__exit__(None, None, None)
        turns.wait()


def test_modes_entered_at_once_on_rank_threads_leave_the_flags_as_they_were():
    """The interleaving itself, forced: without the fix the flags say a mode is active
    on the main thread, where none is, and a compiled idiom recompiles."""
    before = _dispatch_mode_flags()
    run_threaded(2, _enter_and_exit_interleaved, threading.Barrier(2))
    assert _dispatch_mode_flags() == before
    result = check_idiom(next(i for i in IDIOMS if i.name == "full_tensor"), BACKEND)
    assert result.ok, result.error


# Idioms compiled on LocalTensorMode: the mode whose entry passed the flags on to Dynamo.
IDIOMS_AFTER_EAGER = [
    "full_tensor",
    "redistribute_shard_to_replicate",
    "redistribute_partial_to_shard",
    "construct_partial_sum",
    "funcol_all_reduce_mesh",
    "distribute_tensor_2d",
]


@pytest.mark.parametrize("name", IDIOMS_AFTER_EAGER)
def test_idiom_compiles_once_after_an_eager_model_ran_on_rank_threads(name):
    _run_eagerly_on_rank_threads()
    item = next(i for i in IDIOMS if i.name == name)
    assert item.world == "local", item
    result = check_idiom(item, BACKEND)
    # One frame on two calls, eager's values and placements, the user's mesh.
    assert result.ok, result.error
    assert (result.num_frames, result.num_graph_breaks) == (1, 0)


@pytest.mark.slow
def test_the_model_run_eagerly_compiles_once_after_its_threaded_run():
    """The same model, compiled on a simulated world of the same mesh: one frame for three
    steps, the placements and the mesh of eager (a recompile marked its sizes dynamic and
    failed to trace)."""
    _run_eagerly_on_rank_threads()
    counter = CompileCounterWithBackend(BACKEND)
    with simulated_world(4, (4,), ("tp",)) as mesh:
        model = _parallel(mesh)
        compiled = torch.compile(model, backend=counter, fullgraph=True)
        x = torch.randn(4, 16)
        for _ in range(3):
            out = compiled(x)
            out.to_local().pow(2).sum().backward()
        eager = model(x)
    assert counter.frame_count == 1, [str(r) for r in guard_failures[Permuted.forward.__code__]]
    assert not guard_failures[Permuted.forward.__code__]
    assert out.placements == eager.placements == (Replicate(),)
    assert out.device_mesh is mesh
    assert out.shape == eager.shape == (4, 16)
