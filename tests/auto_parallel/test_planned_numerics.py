"""Auto-parallel models compiled with dtcompile equal the single-process model, forward and
parameter gradients: on 4 threaded ranks, and the MLP on 2 real gloo ranks."""

from __future__ import annotations

import pytest
from support.ap_cases import assert_matches_reference, plan_case, rank_apply, rank_step
from torch.distributed.tensor import Replicate

from dtcompile._testing.cases import CASES
from dtcompile.testing import fake_world, run_gloo, run_threaded

R = (Replicate(),)


@pytest.mark.models
def test_tp_mlp_on_4_threaded_ranks():
    # 1/3 of the replicated parameters: the solver must shard.
    budget = (16 * 32 * 2 + 32 + 16) * 4 // 3
    results = run_threaded(4, rank_step, "mlp", (4,), ("tp",), [R], [R], budget)
    assert_matches_reference(results)
    assert results[0][5]["w1.weight"] != R


@pytest.mark.gloo
def test_tp_mlp_on_2_gloo_ranks():
    budget = (16 * 32 * 2 + 32 + 16) * 4 // 2
    assert_matches_reference(run_gloo(2, rank_step, "mlp", (2,), ("tp",), [R], [R], budget))


@pytest.mark.models
def test_fsdp2_over_tp_mlp_on_2x2_threaded_ranks():
    # The bytes of TP + FSDP2 (each tp shard sharded again over dp): the solver stores the
    # column-wise weight and bias _StridedShard over dp, gathered to the tp shard in forward,
    # their gradients reduce-scattered straight back into it.
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    batch_rows = (Shard(0), Replicate())
    budget = ((16 * 32 + 32) // 4 + 16 * 32 // 4 + 16 // 2) * 4
    results = run_threaded(4, rank_step, "mlp_2d", (2, 2), ("dp", "tp"), [batch_rows], [batch_rows], budget)
    assert_matches_reference(results)
    placements = results[0][5]
    assert placements["w1.weight"] == (_StridedShard(0, split_factor=2), Shard(0)), placements


@pytest.mark.models
@pytest.mark.parametrize(
    "case_name, shape",
    [("tp_sp_block", (4,)), ("tp_sp_block_local_map", (4,)), ("fsdp_mlp", (4,)), ("block_2d", (2, 2))],
)
def test_planned_once_applied_on_4_threaded_ranks(case_name, shape):
    # Planned on the fake process group (as it would be offline), applied on each rank's mesh.
    with fake_world(4, shape, CASES[case_name].mesh_dim_names) as mesh:
        *_, solution, _ = plan_case(case_name, mesh)
    assert_matches_reference(run_threaded(4, rank_apply, case_name, 4, solution))


@pytest.mark.models
def test_a_stack_of_tied_blocks_on_4_threaded_ranks():
    from support.ap_cases import build_block_stack

    import dtcompile

    with fake_world(4, (4,), ("tp",)) as mesh:
        reference, _, x = build_block_stack(mesh)
        budget = sum(p.numel() * p.element_size() for p in reference.parameters()) // 4
        solution = dtcompile.auto_parallel.plan(
            reference, mesh, (x,), input_placements=[R], output_placements=[R], param_memory_budget_bytes=budget
        )
    assert solution.result.num_groups < len(solution.problem.nodes) * 0.8  # layers 1 and 2 tied
    results = run_threaded(4, rank_apply, "block_stack", 4, solution)
    assert_matches_reference(results)
    placements = results[0][5]
    assert {n.removeprefix("2."): p for n, p in placements.items() if n.startswith("2.")} == {
        n.removeprefix("1."): p for n, p in placements.items() if n.startswith("1.")
    }


def _rank_copies(rank: int, solution: object, copies: int) -> list[tuple[object, object]]:
    """``copies`` models of different weights, all given ``solution``, each compiled and run:
    per copy, its compiled output and its eager output (this rank's shard)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    import dtcompile
    from dtcompile._testing import models

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(7))
    backend = dtcompile.backend(inductor=False)  # (one backend: another is another cache entry)
    results = []
    for seed in range(copies):
        torch.manual_seed(seed)
        parallel = dtcompile.auto_parallel.parallelize(models.MLP(16, 32), solution, mesh)
        compiled = torch.compile(parallel, backend=backend)
        results.append((compiled(x).to_local(), parallel(x).to_local()))
    return results


@pytest.mark.models
def test_copies_given_one_plan_compile_once_each_with_its_own_weights():
    # Each copy's planned forward was a GraphModule class of its own, which Dynamo guards on:
    # every copy recompiled, and the ninth (past torch's recompile_limit of 8) ran eagerly.
    # Copies given one plan share its forward: one graph per rank, and each copy still
    # computes with its own weights.
    import torch
    from torch._dynamo.utils import counters

    import dtcompile
    from dtcompile._testing import models

    with fake_world(2, (2,), ("tp",)) as mesh:
        solution = dtcompile.auto_parallel.plan(models.MLP(16, 32), mesh, (torch.empty(8, 16, device="meta"),),
                                                param_memory_budget_bytes=(16 * 32 * 2 + 32 + 16) * 4 // 2)
    torch._dynamo.reset()
    counters.clear()
    results = run_threaded(2, _rank_copies, solution, 10)
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])  # one per rank's mesh
    for copies in results:
        for compiled, eager in copies:
            torch.testing.assert_close(compiled, eager)
        # The copies' weights differ, and so do their outputs: none ran another's weights.
        assert len({tuple(c.flatten().tolist()) for c, _ in copies}) == len(copies)
