"""A plan hides the objects the process already held from the garbage collector while it runs
(``gc.freeze``: its full collections walk only what the plan makes), and gives them back."""

from __future__ import annotations

import gc

import torch
from torch import nn

import dtcompile
from dtcompile.auto_parallel import problem as problem_module
from dtcompile.testing import fake_world


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def _plan_seeing_the_heap(monkeypatch) -> dict[str, int]:
    """Plans a small MLP; returns the freeze count before, while the problem is built, and after,
    and what a collection made then found of a cycle dropped during the plan."""
    seen = {"before": gc.get_freeze_count()}
    build = problem_module.build_problem

    def build_and_look(*args, **kwargs):
        seen["during"] = gc.get_freeze_count()
        _Cycle()
        seen["collected"] = gc.collect()
        return build(*args, **kwargs)

    monkeypatch.setattr(problem_module, "build_problem", build_and_look)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model, x = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)), torch.randn(8, 16)
    with fake_world(2, (2,), ("dp",)) as mesh:
        dtcompile.auto_parallel.plan(model, mesh, (x,))
    seen["after"] = gc.get_freeze_count()
    return seen


def test_a_plan_freezes_what_the_process_held_and_gives_it_back(monkeypatch):
    gc.collect()
    assert gc.get_freeze_count() == 0, "the test process froze objects before the test"
    seen = _plan_seeing_the_heap(monkeypatch)
    assert seen["during"] > 1000  # torch's own objects, at least
    assert seen["collected"] >= 1  # what the plan drops is still collected
    assert seen["after"] == 0


def test_a_process_that_froze_its_own_objects_keeps_them_frozen(monkeypatch):
    gc.collect()
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        seen = _plan_seeing_the_heap(monkeypatch)
        # (A frozen object that is freed leaves the count.)  Nothing more is frozen (the model
        # and its inputs, made since, would be), and nothing is handed back.
        assert seen["during"] <= frozen
        assert frozen - 1000 < seen["after"] <= frozen
    finally:
        gc.unfreeze()
