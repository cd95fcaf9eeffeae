"""Ranks run as threads may all plan at once: they plan in turn, each reading what the first measured,
and every rank gets the same plan (ranks that planned differently would run different programs)."""

from __future__ import annotations

import logging
import threading

import dtcompile
from dtcompile._testing import models
from dtcompile.testing import run_threaded


def _plan_on_rank(rank: int, started: threading.Barrier) -> tuple[float, dict[str, tuple[str, ...]], dict[str, int]]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    reference, _, x = models.build_mlp(mesh)
    budget = sum(p.numel() * p.element_size() for p in reference.parameters()) // 3  # it must shard
    started.wait()  # all four call plan at the same moment
    solution = dtcompile.auto_parallel.plan(reference, mesh, (x,), param_memory_budget_bytes=budget)
    layouts = {name: tuple(map(str, layout)) for name, layout in solution.param_placements.items()}
    return solution.cost_us, layouts, dict(solution.problem.measurements)


def test_ranks_as_threads_plan_at_once_and_agree(caplog):
    with caplog.at_level(logging.WARNING, logger="dtcompile.auto_parallel"):
        results = run_threaded(4, _plan_on_rank, threading.Barrier(4))
    costs, layouts, measurements = zip(*results)
    assert len(set(costs)) == 1 and all(found == layouts[0] for found in layouts)
    assert layouts[0]["w1.weight"] != ("Replicate()",)
    # One rank measured; the others found its measurements (the same mesh, one process).
    assert sorted(m.get("made", 0) > 0 for m in measurements) == [False, False, False, True]
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
