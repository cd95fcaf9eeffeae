"""Auto-parallel on the shared models, on the fake process group: under the hand plan's parameter
memory the solution's step, estimated on the compiled graphs with the h100 profile, costs no more
than the hand plan's (Megatron TP + SP for the block, FSDP for the MLP, TP + SP with data
parallelism on the 2-D mesh); its predicted collectives are the compiled graphs' collectives."""

from __future__ import annotations

import pytest
from support.ap_cases import (
    BOUNDARY,
    KEEP_COLLECTIVES,
    compiled_collectives,
    compiled_records,
    plan_case,
    predicted_collectives,
    step_us,
)
from torch.distributed.tensor import distribute_tensor

import dtcompile
from dtcompile._testing.cases import CASES

WORLDS = {"fsdp_mlp": (4, (4,)), "tp_sp_block": (4, (4,)), "block_2d": (8, (2, 4))}


def _check_plan(case_name, fake_world):
    world_size, shape = WORLDS[case_name]
    case = CASES[case_name]
    mesh = fake_world(world_size, shape, case.mesh_dim_names)
    reference, hand, x, solution, hand_bytes = plan_case(case_name, mesh)
    model = dtcompile.auto_parallel.parallelize(reference, solution)
    auto_x = distribute_tensor(x, mesh, BOUNDARY[case_name], src_data_rank=None)
    hand_x = case.local_input(x, mesh)

    held = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    assert held == solution.param_bytes_per_rank() <= hand_bytes

    auto_us = step_us(compiled_records(model, auto_x))
    hand_us = step_us(compiled_records(hand, hand_x))
    assert auto_us <= hand_us * (1 + 1e-9), f"{case_name}: auto {auto_us:.2f} us > hand {hand_us:.2f} us"
    # The solver's own estimate is the compiled graphs' (bucketing included) within 3%.
    assert solution.cost_us == pytest.approx(auto_us, rel=0.03)

    compiled = compiled_collectives(compiled_records(model, auto_x, disable_passes=KEEP_COLLECTIVES))
    assert predicted_collectives(solution) == compiled
    held = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    assert held == solution.param_bytes_per_rank() <= hand_bytes
    return solution, auto_us, hand_us
    return solution, auto_us, hand_us


@pytest.mark.slow
def test_fsdp_mlp_is_no_dearer_than_fsdp_and_predicts_its_collectives(fake_world):
    solution, auto_us, hand_us = _check_plan("fsdp_mlp", fake_world)
    assert auto_us == pytest.approx(hand_us)  # the solver finds FSDP itself
    assert solution.cost_us == pytest.approx(auto_us, rel=0.01)


@pytest.mark.models
def test_tp_sp_block_is_no_dearer_than_megatron_and_predicts_its_collectives(fake_world):
    _check_plan("tp_sp_block", fake_world)


@pytest.mark.models
def test_block_on_a_2d_mesh_is_no_dearer_than_tp_sp_with_dp_and_predicts_its_collectives(fake_world):
    _check_plan("block_2d", fake_world)


def _mlp_on_a_2d_mesh(mesh, rows: int):
    import torch

    from dtcompile._testing import models

    with models._plain_tensors(0) as gen:
        reference = models._init_weights(models.MLP(16, 32), gen)
        x = torch.randn(rows, 16, generator=gen)
    return reference, x


def _auto_against_hand(reference, hand, hand_x, mesh, x, layout):
    """The solution under the hand plan's parameter bytes, and both compiled steps' estimates;
    the solution's predicted collectives are its compiled graphs'."""
    hand_bytes = sum(p.to_local().numel() * p.element_size() for p in hand.parameters())
    model, solution = dtcompile.auto_parallel(
        reference, mesh, (x,), input_placements=[layout], output_placements=[layout], param_memory_budget_bytes=hand_bytes
    )
    auto_x = distribute_tensor(x, mesh, layout, src_data_rank=None)
    held = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    assert held == solution.param_bytes_per_rank() <= hand_bytes
    compiled = compiled_collectives(compiled_records(model, auto_x, disable_passes=KEEP_COLLECTIVES))
    assert predicted_collectives(solution) == compiled
    return solution, step_us(compiled_records(model, auto_x)), step_us(compiled_records(hand, hand_x))


@pytest.mark.models
@pytest.mark.parametrize(
    "shard", [pytest.param(False, id="ddp"), pytest.param(True, id="fsdp2")]
)
def test_mlp_on_a_2d_mesh_is_no_dearer_than_tp_with_data_parallelism(fake_world, shard):
    # The hand plans: Megatron over tp, and over dp the parameters replicated (DDP:
    # gradients all-reduced), as the 2-D block's, or sharded again (FSDP2: each tp shard
    # sharded over dp, _StridedShard where both shard dim 0); the batch sharded over dp.
    import copy

    from torch.distributed.tensor import Replicate, Shard

    from dtcompile._testing import models

    mesh = fake_world(8, (2, 4), ("dp", "tp"))
    reference, x = _mlp_on_a_2d_mesh(mesh, 2 * 4)
    hand = models._data_parallel(models.parallelize_mlp(copy.deepcopy(reference), mesh["tp"]), mesh, shard=shard)
    hand_x = x.chunk(2)[mesh.get_coordinate()[0]]
    _, auto_us, hand_us = _auto_against_hand(reference, hand, hand_x, mesh, x, (Shard(0), Replicate()))
    assert auto_us <= hand_us * (1 + 1e-9), f"auto {auto_us:.2f} us > hand {hand_us:.2f} us"


@pytest.mark.models
def test_fsdp_mlp_on_a_2d_mesh_is_no_dearer_than_fsdp_over_both_axes(fake_world):
    # The hand plan: FSDP over all 8 ranks (the mesh flattened, as torchtitan's dp_shard_cp),
    # every parameter Shard(0), the batch sharded over both axes.  The solver finds it.
    import copy

    from torch.distributed.tensor import Shard

    from dtcompile._testing import models

    mesh = fake_world(8, (2, 4), ("dp", "tp"))
    reference, x = _mlp_on_a_2d_mesh(mesh, 8 * 4)
    flat = mesh._flatten("dp_tp")
    hand = models.parallelize_fsdp_mlp(copy.deepcopy(reference), flat)
    hand_x = x.chunk(8)[flat.get_local_rank()]
    solution, auto_us, hand_us = _auto_against_hand(reference, hand, hand_x, mesh, x, (Shard(0), Shard(0)))
    assert auto_us <= hand_us * (1 + 1e-9)
    assert solution.cost_us == pytest.approx(auto_us, rel=0.01)
