"""The ranks' comparison of their plans, fuzzed against plans made alone.

Each case is a random model of the plan fuzzer (``support.plan_models``) planned and applied on a
threaded world where one random rank plans its own variant: its batch doubled or halved, its budget or
its pins changed, or nothing.  The reference is each variant planned alone on the fake process
group.  Where the two plans are one, every rank must return it (whatever else differs); where they
differ, every rank must raise ``RanksDisagree`` with one message naming the first node whose
placements differ, as the reference plans show it, and the setting that was changed; where a
variant cannot be planned, its rank raises its own ``Infeasible`` and the others a
``RanksDisagree`` quoting it.  Never some ranks with a plan and others without.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from support.ap_cases import KEPT_GATHERED
from support.plan_models import BATCH, MESHES, VOCAB, build, draw_case
from torch.distributed.tensor import Replicate

import dtcompile
from dtcompile.auto_parallel.agreement import plan_lines
from dtcompile.auto_parallel.solver import Infeasible
from dtcompile.ranks.check import RanksDisagree
from dtcompile.testing import fake_world, run_threaded

pytestmark = pytest.mark.fuzz

CI_SEED = 20261129
CI_CASES = 12
# What each change is named as in the error's "what differs".
CHANGES = {"batch x2": "example inputs", "batch /2": "example inputs", "budget": "param_memory_budget_bytes",
           "pins": "pinned", "none": None}


def _variant(seed: int, mesh: str, change: str) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...], dict, int | None]:
    case = draw_case(seed, mesh)
    model, (x,), fixed, budget = build(case)
    if change.startswith("batch"):
        factor = int(change[7:])
        rows = BATCH * factor if change[6] == "x" else BATCH // factor
        x = torch.zeros((rows, *x.shape[1:]), dtype=x.dtype).random_(0, VOCAB) if case.embed else torch.randn(rows, *x.shape[1:])
    elif change == "budget":
        replicated = sum(p.numel() * p.element_size() for p in model.parameters())
        budget = None if budget else replicated // 4
    elif change == "pins":
        name = next(iter(dict(model.named_parameters())))
        fixed = {} if fixed else {name: (Replicate(),) * len(MESHES[mesh][0])}
    return model, (x,), fixed, budget


def _plan(seed: int, mesh_name: str, change: str, mesh: object, apply: bool) -> tuple[str, object]:
    model, args, fixed, budget = _variant(seed, mesh_name, change)
    try:
        solution = dtcompile.auto_parallel.plan(model, mesh, args, fixed=fixed, param_memory_budget_bytes=budget,
                                                config=KEPT_GATHERED)
        if apply:  # (where the ranks compare their plans)
            dtcompile.auto_parallel.parallelize(model, solution, mesh)
    except (Infeasible, RanksDisagree) as exc:
        return type(exc).__name__, str(exc)
    return "plan", plan_lines(solution)


def _rank(rank: int, seed: int, mesh_name: str, change: str, changed_rank: int) -> tuple[str, object]:
    from torch.distributed.device_mesh import init_device_mesh

    shape, names = MESHES[mesh_name]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return _plan(seed, mesh_name, change if rank == changed_rank else "none", mesh, apply=True)


def _alone(seed: int, mesh_name: str, change: str) -> tuple[str, object]:
    shape, names = MESHES[mesh_name]
    with fake_world(math.prod(shape), shape, names) as mesh:
        return _plan(seed, mesh_name, change, mesh, apply=False)


def _cases() -> list[tuple[int, str, str, int]]:
    rng = random.Random(CI_SEED)
    changes = list(CHANGES)
    cases = []
    for i in range(CI_CASES):
        mesh = ("1d2", "2x2")[i % 2]
        world = math.prod(MESHES[mesh][0])
        cases.append((CI_SEED + i, mesh, changes[i % len(changes)], rng.randrange(world)))
    return cases


@pytest.mark.parametrize("seed, mesh_name, change, changed_rank", _cases())
def test_ranks_planning_their_own_variant(seed, mesh_name, change, changed_rank):
    world = math.prod(MESHES[mesh_name][0])
    base, other = _alone(seed, mesh_name, "none"), _alone(seed, mesh_name, change)
    results = run_threaded(world, _rank, seed, mesh_name, change, changed_rank)
    where = f"seed {seed}, mesh {mesh_name}, rank {changed_rank}'s {change}"
    expected = [other if r == changed_rank else base for r in range(world)]
    planned = [kind == "plan" for kind, _ in expected]
    if all(planned) and base == other:
        assert results == expected, f"{where}: the ranks made one plan alone, but not together"
        return
    if not any(planned):
        assert [kind for kind, _ in results] == ["Infeasible"] * world, where
        return
    if not all(planned):
        for r, (kind, text) in enumerate(results):
            if planned[r]:
                assert kind == "RanksDisagree" and "could not plan the model" in text, (where, r, results[r])
            else:
                assert kind == "Infeasible", (where, r, results[r])
        return
    kinds, texts = zip(*results)
    assert kinds == ("RanksDisagree",) * world, (where, results)
    assert len(set(texts)) == 1, where
    # The sides in rank order: rank 0's plan first, the first rank of the other side second.
    ra = 0
    rb = next(r for r in range(world) if expected[r] != expected[0])
    a, b = expected[ra][1], expected[rb][1]
    first = next(((x, y) for x, y in zip(a, b) if x != y), None)
    assert first is not None or len(a) != len(b), where
    if first is not None:
        assert f"first difference: {first[0]} on rank {ra}; {first[1]} on rank {rb}" in texts[0], (where, texts[0])
    differs = texts[0].split("what differs: ")[1].split("\n")[0]
    assert differs.startswith(f"{CHANGES[change]}: "), (where, differs)
