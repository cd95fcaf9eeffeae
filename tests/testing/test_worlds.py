"""The test harness reports the failing rank and never hangs when a rank dies."""

from __future__ import annotations

import functools
import multiprocessing
import os
import socket
import time

import pytest
import torch
import torch.distributed as dist

from dtcompile.testing.worlds import RankFailure, fake_world, run_gloo, run_threaded


def _all_reduce_rank(rank: int) -> float:
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def _raise_on_rank_one(rank: int) -> None:
    if rank == 1:
        raise ValueError("rank one is broken")
    dist.barrier()


def _exit_on_rank_one(rank: int) -> None:
    if rank == 1:
        os._exit(3)
    dist.barrier()


def _raise_on_rank_one_while_rank_zero_computes(rank: int) -> None:
    if rank == 1:
        raise ValueError("rank one is broken")
    time.sleep(30)  # busy outside any collective: it never sees rank 1 go
    dist.barrier()


def test_threaded_ranks_have_real_collectives():
    assert run_threaded(4, _all_reduce_rank) == [10.0] * 4


def _uneven_round_trips(rank: int) -> list[bool]:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    from dtcompile.testing.worlds import _mesh

    mesh = _mesh(4, (2, 2), None)
    cases = [
        ((2, 2), [_StridedShard(1, split_factor=2), Shard(1)], [Replicate(), Shard(0)]),
        ((5,), [Shard(0), Shard(0)], [Replicate(), Replicate()]),
        ((3, 5), [Shard(1), Shard(1)], [Shard(0), Replicate()]),
    ]
    same = []
    for shape, src, dst in cases:
        full = torch.arange(float(torch.Size(shape).numel())).reshape(shape)
        x = distribute_tensor(full, mesh, [Replicate(), Replicate()]).redistribute(mesh, src)
        same.append(torch.equal(x.redistribute(mesh, dst).full_tensor(), full))
    return same


def test_consecutive_threaded_worlds_do_not_share_a_ranks_redistribute_plans():
    """CPython gives a new rank thread a dead one's ident, so a mesh of the next world
    compares equal to one of the last, whose rank (and so its sizes of an uneven shard)
    may differ; DTensor's cached plan for that rank was used (a shape error, or wrong
    sizes) until run_threaded emptied the caches around each world."""
    for _ in range(6):
        assert run_threaded(4, _uneven_round_trips, timeout=120) == [[True] * 3] * 4


_REDUCTIONS = {"sum": torch.sum, "avg": torch.mean, "max": torch.amax, "min": torch.amin, "product": torch.prod}


def _rank_input(rank: int, world_size: int) -> torch.Tensor:
    # Distinct values per rank and element, signs mixed, so that each reduction differs.
    return torch.linspace(-1.0, 1.0, 2 * world_size) * (rank + 1) + rank * 0.25


def _reduce_scatter_each_op(rank: int) -> dict[str, torch.Tensor]:
    import torch.distributed._functional_collectives as funcol

    x = _rank_input(rank, dist.get_world_size())
    group = dist.group.WORLD
    return {op: funcol.reduce_scatter_single(x, op, 0, group).wait() for op in _REDUCTIONS}


@pytest.mark.parametrize("world", ["threaded", pytest.param("gloo", marks=pytest.mark.gloo)])
def test_reduce_scatter_with_every_reduction(world):
    """torch's threaded group reduce-scatters with sum and avg only (NotImplementedError
    for max, which DTensor uses for a Partial("max") tensor, found by the fuzzer);
    the world's agrees with a single-process reference, as gloo's does."""
    world_size = 4 if world == "threaded" else 2
    run = run_threaded if world == "threaded" else functools.partial(run_gloo, timeout=120)
    results = run(world_size, _reduce_scatter_each_op)
    stacked = torch.stack([_rank_input(rank, world_size) for rank in range(world_size)])
    for op, reduce in _REDUCTIONS.items():
        expected = reduce(stacked, dim=0).chunk(world_size)
        for rank in range(world_size):
            torch.testing.assert_close(results[rank][op], expected[rank], msg=f"{op}, rank {rank}")


def test_threaded_failure_names_the_rank():
    with pytest.raises(RankFailure, match=r"rank\(s\) \[1\] failed") as err:
        run_threaded(3, _raise_on_rank_one, timeout=60)
    assert "ValueError: rank one is broken" in str(err.value)


@pytest.mark.gloo
def test_gloo_ranks_have_real_collectives():
    assert run_gloo(2, _all_reduce_rank, timeout=120) == [3.0, 3.0]


def _rendezvous_port(rank: int) -> int:
    dist.barrier()
    return int(os.environ["MASTER_PORT"])


@pytest.mark.gloo
def test_gloo_ranks_meet_at_a_store_this_process_holds_from_before_they_start(monkeypatch):
    # A port picked free and bound by rank 0 seconds later can be taken in between by another
    # run's ranks (CI: "Gloo connectFullMesh failed ... Connection closed by peer").
    import dtcompile.testing.worlds as worlds

    held = []

    def store(world_size: int, timeout: float) -> dist.TCPStore:
        held.append(original(world_size, timeout))
        with pytest.raises(OSError):  # bound already, before any rank starts
            socket.create_server(("127.0.0.1", held[-1].port))
        return held[-1]

    original = worlds._rendezvous_store
    monkeypatch.setattr(worlds, "_rendezvous_store", store)
    assert run_gloo(2, _rendezvous_port) == [held[0].port] * 2
    held[0].set("after", "the run")  # the ranks joined it: it served them, and still serves
    assert held[0].get("after") == b"the run"


@pytest.mark.gloo
def test_gloo_failure_reports_the_traceback_without_hanging():
    start = time.monotonic()
    with pytest.raises(RankFailure) as err:
        run_gloo(2, _raise_on_rank_one, timeout=120)
    # Rank 0 may report the dropped connection too; rank 1's own error is there.
    assert "--- rank 1 ---" in str(err.value)
    assert "ValueError: rank one is broken" in str(err.value)
    assert time.monotonic() - start < 60


@pytest.mark.gloo
def test_gloo_rank_that_dies_is_reported_without_hanging():
    start = time.monotonic()
    with pytest.raises(RankFailure, match="exited with code 3 before returning a result"):
        run_gloo(2, _exit_on_rank_one, timeout=120)
    assert time.monotonic() - start < 60


@pytest.mark.gloo
def test_gloo_failure_is_reported_while_a_peer_is_busy_outside_a_collective():
    """Rank 1's report arrives, then rank 1 exits cleanly while rank 0 computes:
    the run ends after the grace period with rank 1's traceback, rank 0 stopped."""
    start = time.monotonic()
    with pytest.raises(RankFailure) as err:
        run_gloo(2, _raise_on_rank_one_while_rank_zero_computes, timeout=120)
    message = str(err.value)
    assert message.startswith("run_gloo (rank(s) [0] still running, stopped): rank(s) [1] failed\n--- rank 1 ---\n")
    assert "ValueError: rank one is broken" in message
    assert time.monotonic() - start < 25


def test_process_ranks_refuse_a_function_they_cannot_pickle():
    def local_fn(rank: int) -> int:
        return rank

    with pytest.raises(TypeError) as err:
        run_gloo(2, lambda rank: rank)
    lambda_name = f"{__name__}.test_process_ranks_refuse_a_function_they_cannot_pickle.<locals>.<lambda>"
    assert str(err.value) == (
        f"run_gloo: fn {lambda_name} cannot be pickled, and each rank is a process "
        "that receives fn pickled (by module and name); pass a module-level function, "
        "or run a lambda or closure on threads with run_threaded(...)"
    )
    with pytest.raises(TypeError, match=r"fn \S+<locals>\.local_fn cannot be pickled"):
        run_gloo(2, functools.partial(local_fn))
    assert multiprocessing.active_children() == []


def test_fake_world_cleans_up_and_refuses_nesting():
    with fake_world(4):
        assert dist.get_world_size() == 4
        with pytest.raises(RuntimeError, match="already initialized"):
            with fake_world(2):
                pass
    assert not dist.is_initialized()


def _tp_mlp(mesh):
    from dtcompile._testing.models import build_mlp

    # hidden 128: every rank of a 64-rank world holds a (non-empty) column shard.
    _, model, x = build_mlp(mesh, hidden=128)
    return model, (x,)


# Soak: 64 ranks (16 already passes the recompile limit that 8 would not).
@pytest.mark.models
@pytest.mark.parametrize("world_size", [16, pytest.param(64, marks=pytest.mark.soak)])
def test_threaded_worlds_over_eight_ranks_match_eager(world_size):
    """Each rank thread compiles the shared code for its own mesh: the recompile
    limit is the world's, not one rank's (it failed with FailOnRecompileLimitHit)."""
    from dtcompile.testing import assert_matches_eager, threaded_world

    torch._dynamo.reset()
    assert_matches_eager(_tp_mlp, world=threaded_world(world_size))


def _compile_by_name(rank: int) -> float:
    compiled = torch.compile(lambda t: t * 2 + rank, backend="dtcompile", options={"inductor": False})
    return compiled(torch.ones(1)).item()


def test_rank_threads_look_the_backend_up_by_name(monkeypatch):
    """torch registers a backend name check-then-act: rank threads racing on the
    first lookup failed with "duplicate name: dtcompile"."""
    import dynamo_vars
    from dynamo_vars import _install

    dynamo_vars.uninstall()  # torch forgets the name: the next lookup loads the entry point
    real_install = _install.install

    def slow_install():  # a first install that takes a while, as it does in a fresh process
        time.sleep(0.2)
        return real_install()

    monkeypatch.setattr(dynamo_vars, "install", slow_install)
    try:
        assert run_threaded(4, _compile_by_name) == [2.0, 3.0, 4.0, 5.0]
    finally:
        torch._dynamo.reset()


def _reset_then_compile(rank: int, reset: str) -> float:
    def double(t: torch.Tensor) -> torch.Tensor:
        return t * 2 + rank

    first = torch.compile(double, backend="eager")(torch.ones(1)).item()
    if reset == "torch":
        torch._dynamo.reset()
    elif reset == "compiler":
        torch.compiler.reset()
    else:
        from dtcompile.testing import reset_dynamo_on_every_rank

        reset_dynamo_on_every_rank()
    return first + torch.compile(double, backend="eager")(torch.ones(1)).item()


@pytest.mark.parametrize("reset", ["torch", "compiler"])
def test_a_dynamo_reset_on_a_rank_thread_is_refused_and_says_what_to_do(reset):
    """Rank threads share Dynamo's caches: a reset on one freed the code and guards another
    ran, and CI's worker died of a segfault (torch 2.13, tests/clients/test_spmd_typing.py)."""
    before = torch._dynamo.reset
    with pytest.raises(RankFailure) as info:
        run_threaded(2, _reset_then_compile, reset)
    text = str(info.value)
    assert "rank(s) [0, 1] failed" in text, text
    assert "torch._dynamo.reset() on rank 1's thread of run_threaded" in text, text
    assert "reset_dynamo_on_every_rank()" in text and "new backend" in text, text
    assert torch._dynamo.reset is before  # put back after the world
    torch._dynamo.reset()  # and this thread may reset


def test_reset_dynamo_on_every_rank_resets_while_the_other_ranks_wait():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    assert run_threaded(2, _reset_then_compile, "every rank") == [4.0, 6.0]
    # The reset between the two compiles dropped both ranks' first ones: each rank compiled
    # twice (without it, the second compile is a cache hit: 2 graphs).
    assert counters["stats"]["unique_graphs"] == 4, dict(counters["stats"])
