"""Ranks that planned one model differently stop with an error that says why, before either
applies its plan (their models' collectives would not pair up): on threaded ranks and on
real gloo ranks.  Ranks whose plans agree go on, even where what they planned from differs."""

from __future__ import annotations

import time

import pytest
import torch

import dtcompile
from dtcompile._testing import models
from dtcompile.auto_parallel.solver import Infeasible
from dtcompile.rank_check import RanksDisagree
from dtcompile.testing import run_gloo, run_threaded

# The MLP's training step, its batch replicated, needs about 0.6 MB per rank at 4096 rows and
# far less at 64: under this budget a rank planning 4096 rows shards the batch, one planning
# 64 does not.
STEP_BUDGET = 1_000_000


def _plan_rank(rank: int, world: int, batches: list[int], budgets: list[int | None], plans: list[bool] | None = None,
               options: dict[str, object] | None = None) -> tuple[str, str, float]:
    """``rank`` plans the MLP with its own batch and step budget; ``(outcome, what, seconds)``,
    outcome ``plan`` (what: the input's and parameters' placements), or the error's type."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    reference, _, x = models.build_mlp(mesh)
    if plans is not None and not plans[rank]:
        return "none", "", 0.0
    x = torch.empty(batches[rank], x.shape[1], device="meta")
    start = time.perf_counter()
    try:
        solution = dtcompile.auto_parallel.plan(
            reference, mesh, (x,), memory_budget_bytes=budgets[rank],
            config=dtcompile.backend(**{"check_ranks_timeout_s": 120.0, **(options or {})}),
        )
    except (RanksDisagree, Infeasible) as exc:
        return type(exc).__name__, str(exc), time.perf_counter() - start
    placements = {"input0": solution.input_placements[0], **solution.param_placements}
    # The comparison is timed where it ran (real ranks, check_ranks on).
    assert ("ranks_s" in solution.stats) == (options or {}).get("check_ranks", True)
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


def test_a_rank_that_never_plans_is_named_after_the_timeout():
    results = run_threaded(2, _plan_rank, 2, [64, 64], [None, None], [True, False], {"check_ranks_timeout_s": 1.0})
    outcome, message, _ = results[0]
    assert outcome == "RanksDisagree", results[0]
    assert "rank(s) [1] of the mesh's ranks [0, 1] did not finish planning within check_ranks_timeout_s=1 s" in message


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
    return plan_lines(plan_hf(model, (tokens,), mesh))


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
