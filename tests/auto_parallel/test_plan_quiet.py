"""Planning is quiet: DTensor's advice about redistributions it splits, given for each of the
thousands of layouts the planner tries, is not shown to the user; other threads' is."""

from __future__ import annotations

import logging
import threading

import pytest
import torch
from torch import nn

import dtcompile
from dtcompile.testing import fake_world

_ADVICE = "torch.distributed.tensor._redistribute"


@pytest.mark.slow
def test_planning_on_a_2d_mesh_shows_no_redistribution_advice(caplog):
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model, x = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)), torch.randn(8, 16)
    with caplog.at_level(logging.WARNING, logger=_ADVICE), fake_world(4, (2, 2), ("dp", "tp")) as mesh:
        dtcompile.auto_parallel.plan(model, mesh, (x,))
        planned = [r.getMessage() for r in caplog.records if r.name == _ADVICE]
        # The advice is still there for code that is not planning, and after the plan.
        thread = threading.Thread(target=logging.getLogger(_ADVICE).warning, args=("from another thread",))
        thread.start()
        thread.join()
        logging.getLogger(_ADVICE).warning("after the plan")
    assert planned == []
    assert [r.getMessage() for r in caplog.records if r.name == _ADVICE] == ["from another thread", "after the plan"]
