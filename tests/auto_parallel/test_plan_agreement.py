"""Ranks given different plans of one model stop with an error that says why, before either
applies its plan (their models' collectives would not pair up): on threaded ranks and on
real gloo ranks, plans made on the ranks' mesh or on the fake process group.  Ranks whose plans
agree go on, even where what they planned from differs; a plan made on one rank alone waits for
no other."""

from __future__ import annotations

import time

import pytest
import torch

import dtcompile
from dtcompile._testing import models
from dtcompile.auto_parallel.solver import Infeasible
from dtcompile.ranks.check import RanksDisagree
from dtcompile.testing import run_gloo, run_threaded

# The MLP's training step, its batch replicated, needs about 0.6 MB per rank at 4096 rows and
# far less at 64: under this budget a rank planning 4096 rows shards the batch, one planning
# 64 does not.
STEP_BUDGET = 1_000_000


def _plan_rank(rank: int, world: int, batches: list[int], budgets: list[int | None], applies: list[bool] | None = None,
               options: dict[str, object] | None = None) -> tuple[str, str, float]:
    """``rank`` plans the MLP with its own batch and step budget and applies the plan;
    ``(outcome, what, seconds)``, outcome ``plan`` (what: the input's and parameters'
    placements), or the error's type; ``applies[rank]`` false: it plans and does not apply."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    reference, _, x = models.build_mlp(mesh)
    x = torch.empty(batches[rank], x.shape[1], device="meta")
    start = time.perf_counter()
    try:
        solution = dtcompile.auto_parallel.plan(
            reference, mesh, (x,), memory_budget_bytes=budgets[rank],
            config=dtcompile.backend(**{"check_ranks_timeout_s": 120.0, **(options or {})}),
        )
        if applies is None or applies[rank]:
            dtcompile.auto_parallel.parallelize(reference, solution, mesh)
    except (RanksDisagree, Infeasible) as exc:
        return type(exc).__name__, str(exc), time.perf_counter() - start
    placements = {"input0": solution.input_placements[0], **solution.param_placements}
    # The comparison is timed where it ran (applied on real ranks, check_ranks on).
    compared = (applies is None or applies[rank]) and (options or {}).get("check_ranks", True)
    assert ("ranks_s" in solution.stats) == compared
    return "plan", str(placements), time.perf_counter() - start


def test_ranks_given_their_own_batch_stop_saying_so():
    results = run_threaded(4, _plan_rank, 4, [4096, 64, 4096, 4096], [STEP_BUDGET] * 4)
    outcomes, messages, _ = zip(*results)
    assert outcomes == ("RanksDisagree",) * 4, results
    # Every rank says the same: the sides, the first node that differs, the input that differs.
    assert len(set(messages)) == 1
    message = messages[0]
    assert "ranks [0, 2, 3] one, ranks [1] another" in message
    assert "first difference: input0: -> S(0) on rank 0; input0: -> R on rank 1" in message
    assert "example inputs: float32[4096, 16] on rank 0, float32[64, 16] on rank 1" in message
    assert "memory_budget_bytes" not in message.split("what differs:")[1].split("Fix:")[0]


def test_ranks_whose_plans_agree_go_on_though_their_batches_differ():
    # Without a step budget every rank keeps the batch replicated, 4096 rows or 64: one plan.
    results = run_threaded(4, _plan_rank, 4, [4096, 64, 4096, 4096], [None] * 4)
    assert {outcome for outcome, _, _ in results} == {"plan"}, results
    assert len({what for _, what, _ in results}) == 1


def test_a_rank_that_cannot_plan_stops_its_peers_at_once():
    # Rank 2's budget is below any plan's peak: it raises its own error; its peers, which
    # planned, quote it at once rather than wait for it.
    results = run_threaded(4, _plan_rank, 4, [4096] * 4, [STEP_BUDGET, STEP_BUDGET, 1000, STEP_BUDGET])
    assert results[2][0] == "Infeasible"
    for rank in (0, 1, 3):
        outcome, message, seconds = results[rank]
        assert outcome == "RanksDisagree", results[rank]
        assert "rank(s) [2] of the mesh's ranks [0, 1, 2, 3] could not plan the model (rank 2: Infeasible:" in message
        assert seconds < 60


def test_a_rank_that_never_applies_its_plan_is_named_after_the_timeout():
    results = run_threaded(2, _plan_rank, 2, [64, 64], [None, None], [True, False], {"check_ranks_timeout_s": 1.0})
    outcome, message, _ = results[0]
    assert outcome == "RanksDisagree", results[0]
    assert "rank(s) [1] of the mesh's ranks [0, 1] did not come to apply their plan within check_ranks_timeout_s=1 s" in message
    assert results[1][0] == "plan"


def _plan_alone(rank: int) -> tuple[str, float]:
    """Rank 0 alone plans on the ranks' mesh (to look at the plan); rank 1 does not plan."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    if rank != 0:
        return "", 0.0
    start = time.perf_counter()
    solution = dtcompile.auto_parallel.plan(models.MLP(16, 32), mesh, (torch.empty(64, 16, device="meta"),),
                                            config=dtcompile.backend(check_ranks_timeout_s=30.0))
    return str(solution.param_placements), time.perf_counter() - start


def test_a_plan_made_on_one_rank_alone_waits_for_no_other():
    # Planning compares nothing: rank 0 gets its plan at once, though rank 1 never plans
    # (the comparison happens where plans are applied, and this one is not).
    (placements, seconds), _ = run_threaded(2, _plan_alone)
    assert "w1.weight" in placements and seconds < 30


def _apply_rank(rank: int, solutions: list[object]) -> tuple[str, str]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (len(solutions),), mesh_dim_names=("tp",))
    reference, _, _ = models.build_mlp(mesh)
    try:
        parallel = dtcompile.auto_parallel.parallelize(reference, solutions[rank], mesh)
    except RanksDisagree as exc:
        return "RanksDisagree", str(exc)
    return "applied", str({name: p.placements for name, p in parallel.named_parameters()})


def _fake_plans(batches: list[int], budget: int | None, options: dict[str, object] | None = None) -> list[object]:
    """The MLP planned on the fake process group once per batch (as each rank of a job that plans
    before it starts its process group would), on the threaded ranks' 4-rank mesh."""
    from dtcompile.testing import fake_world

    plans = []
    for rows in batches:
        with fake_world(len(batches), (len(batches),), ("tp",)) as mesh:
            reference, _, x = models.build_mlp(mesh)
            plans.append(dtcompile.auto_parallel.plan(
                reference, mesh, (torch.empty(rows, x.shape[1], device="meta"),), memory_budget_bytes=budget,
                config=dtcompile.backend(**(options or {})),
            ))
    return plans


def test_plans_made_on_the_fake_group_from_each_ranks_own_batch_stop_where_they_are_applied():
    # The documented way (plan on the fake process group, apply on every rank) compares too:
    # each rank's plan from its own batch differs, and every rank stops before distributing.
    solutions = _fake_plans([4096, 64, 4096, 4096], STEP_BUDGET)
    results = run_threaded(4, _apply_rank, solutions)
    assert [outcome for outcome, _ in results] == ["RanksDisagree"] * 4, results
    assert len({message for _, message in results}) == 1
    assert "first difference: input0: -> S(0) on rank 0; input0: -> R on rank 1" in results[0][1]
    assert "example inputs: float32[4096, 16] on rank 0, float32[64, 16] on rank 1" in results[0][1]
    # One plan made once on the fake group, applied on every rank: the ranks go on.
    results = run_threaded(4, _apply_rank, solutions[:1] * 4)
    assert [outcome for outcome, _ in results] == ["applied"] * 4
    assert len({what for _, what in results}) == 1


def test_check_ranks_false_leaves_the_ranks_their_own_plans():
    results = run_threaded(4, _plan_rank, 4, [4096, 64, 4096, 4096], [STEP_BUDGET] * 4, None, {"check_ranks": False})
    assert [outcome for outcome, _, _ in results] == ["plan"] * 4
    assert results[0][1] != results[1][1]  # the plans differ: nothing stopped them


@pytest.mark.gloo
def test_gloo_ranks_given_their_own_batch_stop_saying_so():
    # (Two ranks: half the rows of the threaded test, so that the larger batch still fits sharded.)
    results = run_gloo(2, _plan_rank, 2, [2048, 32], [STEP_BUDGET] * 2)
    assert [outcome for outcome, _, _ in results] == ["RanksDisagree"] * 2, results
    assert "first difference: input0: -> S(0) on rank 0; input0: -> R on rank 1" in results[0][1]
    assert "example inputs: float32[2048, 16] on rank 0, float32[32, 16] on rank 1" in results[0][1]
    assert results[0][1] == results[1][1]


def _plan_hf_rank(rank: int, seqs: list[int]) -> list[str]:
    from support.hf_models import BATCH, build, plan_hf
    from torch.distributed.device_mesh import init_device_mesh

    from dtcompile.auto_parallel.agreement import plan_lines

    mesh = init_device_mesh("cpu", (len(seqs),), mesh_dim_names=("tp",))
    model, _ = build("gpt2")
    tokens = torch.randint(3, 50, (BATCH, seqs[rank]), generator=torch.Generator().manual_seed(rank))
    solution = plan_hf(model, (tokens,), mesh)
    dtcompile.auto_parallel.parallelize(model, solution, mesh)  # (where the ranks compare)
    return plan_lines(solution)


@pytest.mark.models
def test_hf_ranks_given_their_own_padded_batch_go_on_where_their_plans_agree():
    # Each rank's batch padded to its own longest sequence (16 and 11 tokens), as a data loader
    # with dynamic padding gives them: GPT-2's plan is the same for both, so both ranks go on.
    from support.hf_models import BATCH, build, plan_hf, require_transformers

    from dtcompile.auto_parallel.agreement import plan_lines
    from dtcompile.testing import fake_world

    require_transformers()
    model, _ = build("gpt2")
    with fake_world(2, (2,), ("tp",)) as mesh:
        alone = [plan_lines(plan_hf(model, (torch.zeros(BATCH, seq, dtype=torch.long),), mesh)) for seq in (16, 11)]
    assert alone[0] == alone[1]
    assert run_threaded(2, _plan_hf_rank, [16, 11]) == alone
