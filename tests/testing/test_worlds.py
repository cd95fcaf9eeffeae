"""The test harness reports the failing rank and never hangs when a rank dies."""

from __future__ import annotations

import os
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


def test_threaded_ranks_have_real_collectives():
    assert run_threaded(4, _all_reduce_rank) == [10.0] * 4


def test_threaded_failure_names_the_rank():
    with pytest.raises(RankFailure, match=r"rank\(s\) \[1\] failed") as err:
        run_threaded(3, _raise_on_rank_one, timeout=60)
    assert "ValueError: rank one is broken" in str(err.value)


def test_gloo_ranks_have_real_collectives():
    assert run_gloo(2, _all_reduce_rank, timeout=120) == [3.0, 3.0]


def test_gloo_failure_reports_the_traceback_without_hanging():
    start = time.monotonic()
    with pytest.raises(RankFailure) as err:
        run_gloo(2, _raise_on_rank_one, timeout=120)
    # Rank 0 may report the dropped connection too; rank 1's own error is there.
    assert "--- rank 1 ---" in str(err.value)
    assert "ValueError: rank one is broken" in str(err.value)
    assert time.monotonic() - start < 60


def test_gloo_rank_that_dies_is_reported_without_hanging():
    start = time.monotonic()
    with pytest.raises(RankFailure, match="exited with code 3 before returning a result"):
        run_gloo(2, _exit_on_rank_one, timeout=120)
    assert time.monotonic() - start < 60


def test_fake_world_cleans_up_and_refuses_nesting():
    with fake_world(4):
        assert dist.get_world_size() == 4
        with pytest.raises(RuntimeError, match="already initialized"):
            with fake_world(2):
                pass
    assert not dist.is_initialized()
