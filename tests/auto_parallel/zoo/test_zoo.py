"""The zoo (``tests/support/zoo_models.py``): torch.nn models the team did not design, and
torchtitan's Llama3 and dense Qwen3, each planned on a 1-D mesh of 4 and on a 2 x 2 mesh under half
the replicated parameter bytes, compiled with dtcompile on 4 threaded ranks: output and every
parameter gradient equal the single-process model's, the predicted collectives are the compiled
graphs', and the parallel model names every parameter and buffer as the user's model does."""

from __future__ import annotations

import copy

import pytest
import torch
from support.ap_cases import (
    KEEP_COLLECTIVES,
    KEPT_GATHERED,
    apply_and_step,
    assert_matches_reference,
    assert_same_optimum,
    predicted_collectives,
    sharded_budget,
    step_against_reference,
)
from support.zoo_models import ZOO, build
from torch.distributed.tensor import Replicate

import dtcompile
from dtcompile.testing import fake_world, run_gloo, run_threaded

MESHES = {"1d": ((4,), ("tp",)), "2x2": ((2, 2), ("dp", "tp"))}


def _plan(model, args, mesh_name, world_size=4):
    shape, names = MESHES[mesh_name] if world_size == 4 else ((world_size,), ("tp",))
    with fake_world(world_size, shape, names) as mesh:
        return dtcompile.auto_parallel.plan(model, mesh, args, param_memory_budget_bytes=sharded_budget(model), config=KEPT_GATHERED)


def _rank_step(rank, reference, args, mesh_name, solution):
    return apply_and_step(rank, reference, args, *MESHES[mesh_name], solution)


def _check(solution, results):
    assert_same_optimum(solution)
    assert_matches_reference(results, rtol=1e-4, atol=1e-5)
    predicted = predicted_collectives(solution)
    for rank, result in enumerate(results):
        assert result[6] == predicted, f"rank {rank}: compiled {result[6]}, predicted {predicted}"
    assert solution.param_bytes_per_rank() <= solution.param_memory_budget_bytes
    assert any(layout != (Replicate(),) * len(layout) for layout in solution.param_placements.values())


@pytest.mark.models
@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_model_on_4_threaded_ranks_equals_the_single_process_model(name, mesh_name):
    model, args = build(name)
    solution = _plan(model, args, mesh_name)
    _check(solution, run_threaded(4, _rank_step, model, args, mesh_name, solution))


@pytest.mark.parametrize("mesh_name", [pytest.param(m, marks=pytest.mark.models) if m == "2x2" else m for m in MESHES])
def test_the_issues_norm_blocks_plan_where_the_solver_raised_index_error(mesh_name):
    # LayerNorm's mean and rstd take no gradient: counted as if they did, the norm had no
    # candidate left and the solver an edge of shape (0,) (IndexError in solver.py).
    for name in ("gated_mlp_block", "small_lm"):
        model, args = build(name)
        solution = _plan(model, args, mesh_name)
        norm = solution.problem.nodes["native_layer_norm"]
        assert norm.requires_grad == [True, False, False]
        assert len(norm.candidates) > 1
        assert solution.param_bytes_per_rank() <= sharded_budget(model)


def _gloo_rank_step(rank, name):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    reference, args = build(name)
    solution = dtcompile.auto_parallel.plan(
        reference, mesh, args, param_memory_budget_bytes=sharded_budget(reference), config=KEPT_GATHERED
    )
    model = dtcompile.auto_parallel.parallelize(copy.deepcopy(reference), solution, mesh)
    result = step_against_reference(rank, model, reference, args, mesh, solution, KEEP_COLLECTIVES, reshard=False)
    return (*result, predicted_collectives(solution))


@pytest.mark.parametrize("name", ["multihead_attention", "small_lm"])
@pytest.mark.gloo
def test_zoo_model_on_2_gloo_ranks_equals_the_single_process_model(name):
    results = run_gloo(2, _gloo_rank_step, name)
    assert_matches_reference([r[:7] for r in results], rtol=1e-4, atol=1e-5)
    for rank, result in enumerate(results):
        assert result[6] == result[7], f"rank {rank}: compiled {result[6]}, predicted {result[7]}"


def _rank_state_dicts(rank, reference, args, solution):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    model = dtcompile.auto_parallel.parallelize(reference, solution, mesh)
    full = StateDictOptions(full_state_dict=True)
    # Parallel -> user: the gathered state dict loads, strictly, into the user's model.
    out = get_model_state_dict(model, options=full)
    user = copy.deepcopy(reference)
    with torch.no_grad():
        for p in user.parameters():
            p.zero_()
    user.load_state_dict(out, strict=True)
    # User -> parallel: another user model's state dict loads into the parallel model.
    other = copy.deepcopy(reference)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(-2)
    set_model_state_dict(model, other.state_dict(), options=full)
    back = {n: p.full_tensor() for n, p in model.named_parameters()}
    return list(model.state_dict()), user.state_dict(), back, other.state_dict()


@pytest.mark.models
@pytest.mark.parametrize("name", ["tied_embeddings_lm", "with_buffers"])
def test_state_dicts_move_both_ways_between_the_user_and_the_parallel_model(name):
    reference, args = build(name)
    solution = _plan(reference, args, "1d")
    results = run_threaded(4, _rank_state_dicts, reference, args, solution)
    expected = reference.state_dict()
    for rank, (keys, user, back, other) in enumerate(results):
        assert keys == list(expected), f"rank {rank}: {keys}"
        for key, value in expected.items():
            torch.testing.assert_close(user[key], value, rtol=0, atol=0, msg=lambda m, k=key: f"rank {rank}, {k}: {m}")
        for key, value in back.items():
            torch.testing.assert_close(value, other[key], rtol=0, atol=0, msg=lambda m, k=key: f"rank {rank}, {k}: {m}")
