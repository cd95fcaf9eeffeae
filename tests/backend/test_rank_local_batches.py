"""Ranks fed batches of their own sizes run as on stock torch, with their collectives bucketed.

Padding to each rank's longest sequence, packed sequences, a short last batch: each
rank of a data-parallel job sees batches of its own size.  dtcompile's bucketing
prices each merge from its rank's own shapes (the compute between two gathers, the
activations alive at the peak), so two ranks could bucket the same parameters'
gathers differently and their collectives would not pair: the check stopped both
ranks (``RanksDisagree ... 8 collectives against 9``), and with the check off gloo
aborted (``Received data size doesn't match expected size. 16512 vs 128``).  The
ranks now settle one plan per group (:mod:`dtcompile.ranks.plans`).

Each program is a SimpleFSDP stack on two gloo ranks, rank 0 fed 8 rows a step and
rank 1 fewer, compiled and compared with the same model run eagerly on the same rank
(outputs, gradients, the optimizer's state) and with the single-process model; the
forward stays bucketed, on both ranks alike.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import dtcompile
from dtcompile.records import Action
from dtcompile.testing import run_gloo

DIM, HIDDEN, LAYERS = 64, 256, 2
TOL = dict(rtol=1e-5, atol=1e-5)


def _batch(rank: int, step: int, rows: int) -> torch.Tensor:
    return torch.randn(rows, DIM, generator=torch.Generator().manual_seed(1000 * step + rank))


def _models(mesh: Any) -> tuple[torch.nn.Module, torch.nn.Module, torch.nn.Module]:
    from dtcompile._testing.models import build_norm_mlp_stack

    reference, parallel, _ = build_norm_mlp_stack(mesh, rows=8, dim=DIM, hidden=HIDDEN, layers=LAYERS)
    _, eager, _ = build_norm_mlp_stack(mesh, rows=8, dim=DIM, hidden=HIDDEN, layers=LAYERS)
    return reference, parallel, eager


def _decisions(records: Any, kind: str, action: Action) -> list[str]:
    return [
        d.text for r in records if str(r.kind) == kind for p in r.passes if p.name == "bucketing"
        for d in p.decisions if d.action is action
    ]


def _without_names(buckets: list[str]) -> list[str]:
    """``all_gather[10 -> 1] (199936 B)`` for each bucket, sorted: what the ranks send
    (node names differ between one rank's graphs of one step)."""
    return sorted(f"{text.split(':')[0]} ({text.rsplit('(', 1)[1]}" for text in buckets)


def _reference_grads(reference: torch.nn.Module, rows_by_rank: list[int], step: int, mesh: Any) -> list[torch.Tensor]:
    """This rank's shard of the gradient data parallelism computes: the mean over ranks of
    each rank's own loss's gradient, on the single-process model."""
    reference.zero_grad(set_to_none=True)
    world = len(rows_by_rank)
    for rank, rows in enumerate(rows_by_rank):
        (reference(_batch(rank, step, rows)).sum() / world).backward()
    me = mesh.get_local_rank()
    return [p.grad.chunk(world)[me] for p in reference.parameters()]


def _dynamo_on_rank(rank: int, rows: list[list[int]], check_ranks: bool) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    reference, model, eager = _models(mesh)
    backend = dtcompile.backend(inductor=False, check_ranks=check_ranks)
    compiled = torch.compile(model, backend=backend)
    steps = []
    for step, n in enumerate(rows[rank]):
        x = _batch(rank, step, n)
        got = compiled(x)
        got.sum().backward()
        want = eager(x)
        want.sum().backward()
        grads = [p.grad.to_local() for p in model.parameters()]
        eager_grads = [p.grad.to_local() for p in eager.parameters()]
        reference_grads = _reference_grads(reference, [r[step] for r in rows], step, mesh)
        with torch.no_grad():
            single = reference(x)
        steps.append({"got": got.detach(), "eager": want.detach(), "single": single, "grads": grads,
                      "eager_grads": eager_grads, "reference_grads": reference_grads})
        for module in (model, eager):
            module.zero_grad(set_to_none=True)
    return {
        "steps": steps,
        "forward_buckets": _decisions(backend.records, "forward", Action.BUCKETED),
        "forward_buckets_by_graph": [
            _without_names(_decisions([r], "forward", Action.BUCKETED)) for r in backend.records if str(r.kind) == "forward"
        ],
        "agreed": _decisions(backend.records, "forward", Action.AGREED),
        "checks": [str(c.outcome) for c in backend.checks],
        "graphs": sorted({r.compile_id for r in backend.records}),
    }


def _assert_equal_to_eager_and_single_process(runs: list[dict[str, Any]]) -> None:
    for rank, run in enumerate(runs):
        for step, got in enumerate(run["steps"]):
            where = f"rank {rank} step {step}"
            torch.testing.assert_close(got["got"], got["eager"], **TOL, msg=where)
            torch.testing.assert_close(got["got"], got["single"], **TOL, msg=where)
            for a, b, c in zip(got["grads"], got["eager_grads"], got["reference_grads"], strict=True):
                torch.testing.assert_close(a, b, **TOL, msg=where)
                torch.testing.assert_close(a, c, **TOL, msg=where)


@pytest.mark.gloo
@pytest.mark.parametrize("rank1_rows", [[6, 6, 6], [6, 4, 6]], ids=["6-6-6", "6-4-6"])
def test_dynamo_ranks_fed_batches_of_their_own_sizes_run_bucketed_as_eager(rank1_rows):
    """Rank 0: 8, 8, 8 rows; rank 1: ``rank1_rows`` (with a 4 it recompiles alone, dynamic)."""
    runs = run_gloo(2, _dynamo_on_rank, [[8, 8, 8], rank1_rows], True, timeout=240)
    _assert_equal_to_eager_and_single_process(runs)
    first, second = runs
    # One rank's own plan (the first to compile) is every rank's: the forward is bucketed on both
    # ranks alike, and the rank whose own plan differed (its shapes do) says whose it applies.
    assert len(first["forward_buckets"]) >= 2, first["forward_buckets"]
    (theirs,) = first["forward_buckets_by_graph"]
    assert all(buckets == theirs for buckets in second["forward_buckets_by_graph"]), runs
    adopted = [rank for rank, run in enumerate(runs) if any("settled for these collectives" in a for a in run["agreed"])]
    assert len(adopted) == 1, [run["agreed"] for run in runs]
    assert first["checks"][0] == "agreed" and second["checks"][0] == "agreed", (first["checks"], second["checks"])
    if 4 in rank1_rows:
        # Rank 1's recompile for its 4 rows took the plan its ranks settled and needed no exchange.
        assert len(second["graphs"]) == len(first["graphs"]) + 1, (first["graphs"], second["graphs"])
        assert second["checks"][-1] == "agreed on by an earlier graph", second["checks"]


def _step_on_rank(rank: int, rows: list[list[int]], check_ranks: bool) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    _, model, eager = _models(mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, foreach=False)
    eager_optimizer = torch.optim.AdamW(eager.parameters(), lr=0.01, foreach=False)
    step = dtcompile.compile_step(
        lambda x: model(x).pow(2).mean(), model=model, optimizer=optimizer, inductor=False, check_ranks=check_ranks
    )
    losses, params = [], []
    for i, n in enumerate(rows[rank]):
        x = _batch(rank, i, n)
        loss = step(x)
        want = eager(x).pow(2).mean()
        want.backward()
        eager_optimizer.step()
        eager_optimizer.zero_grad(set_to_none=True)
        losses.append((loss.item(), want.item()))
        params.append([(p.to_local().clone(), q.to_local().clone()) for p, q in zip(model.parameters(), eager.parameters())])
    records = step.step_pass.records
    return {
        "losses": losses,
        "params": params,
        "buckets": [_without_names(_decisions([r], "step", Action.BUCKETED)) for r in records],
        "agreed": _decisions(records, "step", Action.AGREED),
        "checks": [str(c.outcome) for c in step.step_pass.checks],
        "traces": step.traces,
    }


@pytest.mark.gloo
@pytest.mark.parametrize("check_ranks", [True, False], ids=["check", "no-check"])
def test_compile_step_with_adamw_ranks_fed_batches_of_their_own_sizes_equal_eager(check_ranks):
    """Rank 0: 8 rows every step; rank 1: 8, 6, 8, 6 (re-traced alone at the second step)."""
    runs = run_gloo(2, _step_on_rank, [[8, 8, 8, 8], [8, 6, 8, 6]], check_ranks, timeout=240)
    for rank, run in enumerate(runs):
        for i, (got, want) in enumerate(run["losses"]):
            assert got == pytest.approx(want, rel=1e-5, abs=1e-6), f"rank {rank} step {i}: {run['losses']}"
        for i, pairs in enumerate(run["params"]):
            for p, q in pairs:
                torch.testing.assert_close(p, q, **TOL, msg=f"rank {rank} step {i}")
    first, second = runs
    assert first["traces"] == 1 and second["traces"] == 2, (first["traces"], second["traces"])
    # Every step graph of both ranks buckets alike (the plan the first rank to trace settled).
    assert first["buckets"][0], first["buckets"]
    assert all(b == first["buckets"][0] for b in second["buckets"]), second["buckets"]
    if check_ranks:
        assert first["checks"] == ["agreed"], first["checks"]
        assert second["checks"] == ["agreed", "agreed on by an earlier graph"], second["checks"]


def _planted_on_rank(rank: int, rows: list[list[int]]) -> str:
    """The Dynamo program with bucketing's settlement planted away: each rank applies the plan
    it priced from its own batch, as a pass that reads a rank-local size into its decision."""
    from dtcompile.ranks.check import RanksDisagree
    from dtcompile.ranks.plans import Adoption, AgreedPlan, PlanMeeting

    def each_rank_its_own(self: PlanMeeting, what: str, plans: Any) -> list[AgreedPlan]:
        return [AgreedPlan(p.group, p.plan, Adoption.LOCAL) for p in plans]

    PlanMeeting.agree = each_rank_its_own
    try:
        _dynamo_on_rank(rank, rows, True)
    except RanksDisagree as exc:
        return str(exc)
    return "ran"


@pytest.mark.gloo
def test_a_pass_that_decides_from_its_ranks_own_batch_is_caught_and_named_dtcompiles_bug():
    messages = run_gloo(2, _planted_on_rank, [[8, 8, 8], [6, 6, 6]], timeout=240)
    for message in messages:
        assert "ranks compiled graph 0/0 differently" in message, message
        assert "cause: dtcompile's own" in message and "a bug in dtcompile" in message, message
        # The user gave every rank the same options: the message does not tell them to.
        assert "Fix: give every rank the same" not in message, message


def _backward_collectives(rows: list[int], **options: Any) -> list[str]:
    """The last backward's collectives as traced, compiled on one simulated rank fed ``rows``."""
    from dtcompile._testing.models import build_norm_mlp_stack
    from dtcompile.testing import fake_world

    with fake_world(2) as mesh:
        torch._dynamo.reset()
        _, model, _ = build_norm_mlp_stack(mesh, rows=1, dim=8, hidden=16, layers=2, seed=36479)
        backend = dtcompile.backend(inductor=False, **options)
        compiled = torch.compile(model, backend=backend)
        for n in rows:
            compiled(torch.randn(n, 8)).sum().backward()
    (last, *_) = [r for r in reversed(backend.records) if r.kind == "backward"]
    return [f"{c.op}{list(c.shape)}" for c in last.collectives_traced]


@pytest.mark.slow
def test_the_traced_backward_issues_one_order_whatever_a_ranks_rows():
    """Without dtcompile's re-gathers the traced collectives pair whatever each rank's rows."""
    assert _backward_collectives([3, 2, 1], reshard_after_forward=False) == _backward_collectives([4, 3, 2], reshard_after_forward=False)


@pytest.mark.slow
def test_the_backward_re_gathers_issue_one_order_whatever_a_ranks_rows():
    """Rank 0 specialized to 1 row at the third step, rank 1 on its dynamic graph at 2: min-cut
    recomputed the LayerNorm's output at 1 row only, re-gathering its weight before a
    reduce-scatter (tests/fuzz/test_rank_shapes.py, SIMPLE_FSDP_ONE_ROW_ON_ONE_RANK)."""
    assert _backward_collectives([3, 2, 1]) == _backward_collectives([4, 3, 2])


def _dp_plan_on_rank(rank: int, claim_order: list[int]) -> tuple[tuple[int, ...], ...]:
    """FSDP x TP on 2 x 2 (ranks 0 and 1 are one dp coordinate, a tensor-parallel group; 2
    and 3 the other): each rank's own bucket plan for its dp group's gathers is priced from its
    dp coordinate's batch (coordinate 0 merges all four, coordinate 1 two pairs); the ranks
    reach the meeting in ``claim_order``.  What each rank applies."""
    import time

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from dtcompile.ranks.plans import GroupPlan, PlanMeeting

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    own = ((0, 1, 2, 3),) if rank in (0, 1) else ((0, 1), (2, 3))
    mine = GroupPlan(mesh["dp"].get_group().group_name, "4 all_gather float32 x2 [64, 64, 64, 64]", own, "dp")
    for turn in claim_order:  # ranks as threads: the earlier ones reach the meeting first
        if turn == rank:
            break
        time.sleep(0.3)
    (agreed,) = PlanMeeting(timeout_s=60.0).agree("bucketing/step/test", [mine])
    dist.barrier()
    return agreed.plan


def test_every_dp_group_applies_one_plan_so_tensor_parallel_peers_compile_alike():
    """The 1,000-program run's FSDP x TP finds (programs 107, 164, 451, ...: RanksDisagree on the
    tp group): each dp group settled its own bucket plan, the first of its ranks to compile it
    deciding; where dp group {0, 2} took rank 2's plan and {1, 3} rank 1's, the tensor-parallel
    peers 0 and 1 compiled different graphs.  One plan now serves every group of the axis."""
    from dtcompile.testing import run_threaded

    for order in ([2, 1, 0, 3], [1, 2, 3, 0], [0, 3, 1, 2]):
        plans = run_threaded(4, _dp_plan_on_rank, order)
        assert len(set(plans)) == 1, f"claim order {order}: {plans}"
        first = order[0]
        assert plans[0] == (((0, 1, 2, 3),) if first in (0, 1) else ((0, 1), (2, 3))), (order, plans)
