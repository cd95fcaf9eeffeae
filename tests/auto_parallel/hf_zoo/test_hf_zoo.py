"""The HuggingFace zoo (``hf_models.py``): models as people download them from ``transformers``,
tiny and randomly initialised, planned by ``dtcompile.auto_parallel`` on a fake 1-D mesh of 4 and
a fake 2 x 2 mesh; a subset compiled with dtcompile on 4 threaded ranks, equal to the
single-process model (output and every gradient); and, on the 1-D mesh, the plan's compiled step
against transformers' own tensor-parallel plan (``base_model_tp_plan``) applied with torch's
``parallelize_module``, under the same cost profile.  ``benchmarks/hf_zoo.py`` records the whole
comparison in ``benchmarks/RESULTS.md``."""

from __future__ import annotations

import copy

import pytest
import torch
from ap_cases import (
    KEEP_COLLECTIVES,
    KEPT_GATHERED,
    assert_matches_reference,
    compiled_records,
    predicted_collectives,
    step_against_reference,
    step_us,
)
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

import dtcompile
from dtcompile.testing import fake_world, run_threaded

from hf_models import HF_ZOO, build, hf_tp_plan, require_transformers

pytestmark = pytest.mark.models


@pytest.fixture(autouse=True)
def _transformers():
    require_transformers()

MESHES = {"1d": ((4,), ("tp",)), "2x2": ((2, 2), ("dp", "tp"))}


def _budget(model):
    """Half the replicated parameter bytes: the solver must shard."""
    return sum(p.numel() * p.element_size() for p in model.parameters()) // 2


def _plan(model, args, mesh, **options):
    options.setdefault("param_memory_budget_bytes", _budget(model))
    return dtcompile.auto_parallel.plan(model, mesh, args, config=KEPT_GATHERED, **options)


@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("name", list(HF_ZOO))
def test_hf_model_plans_and_keeps_the_users_names(name, mesh_name):
    model, args = build(name)
    shape, names = MESHES[mesh_name]
    with fake_world(4, shape, names) as mesh:
        solution = _plan(model, args, mesh)
        parallel = dtcompile.auto_parallel.parallelize(model, solution)
    assert solution.param_bytes_per_rank() <= solution.param_memory_budget_bytes
    assert any(layout != (Replicate(),) * len(shape) for layout in solution.param_placements.values())
    assert [n for n, _ in parallel.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert list(parallel.state_dict()) == list(model.state_dict())
    # Every node is explained: one line per placed node, each with its placement and cost.
    explained = solution.explain()
    assert "placement=" in explained and "cost=" in explained


def test_constants_built_in_forward_are_planned_replicated_not_refused():
    # Falcon's attention builds small index tensors in forward (torch.tensor([-1]) and the
    # like, traced as get_attr constants fed to lift_fresh_copy): once refused with "make it
    # a buffer", which no user of the model can do.
    model, args = build("falcon")
    with fake_world(4, (4,), ("tp",)) as mesh:
        solution = _plan(model, args, mesh)
    constants = [n for n in solution.problem.nodes.values() if n.kind == "constant" and n.fx_node.op == "get_attr"]
    assert constants, "the trace lifted no tensor constant: the test no longer covers the case"
    for node in constants:
        assert [c.outputs for c in node.candidates] == [((Replicate(),),)]


def _rank_step(rank, reference, args, mesh_name, solution):
    from torch.distributed.device_mesh import init_device_mesh

    shape, names = MESHES[mesh_name]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    reference = copy.deepcopy(reference)  # each rank's own: gradients accumulate on it
    model = dtcompile.auto_parallel.parallelize(reference, solution, mesh)
    return step_against_reference(rank, model, reference, args, mesh, solution, KEEP_COLLECTIVES, reshard=False)


# Compiled on 4 threaded ranks: a decoder with RoPE and SDPA, GPT-2's fused Conv1D projections on
# the 2-D mesh, a mixture of experts (data-dependent routing), Falcon (constants built in forward),
# T5 (an encoder-decoder with relative position buckets) and ViT (images).
COMPILED = [("llama", "1d"), ("gpt2", "2x2"), ("mixtral", "1d"), ("falcon", "1d"), ("t5", "1d"), ("vit", "2x2")]


@pytest.mark.parametrize(("name", "mesh_name"), COMPILED)
def test_hf_model_compiled_on_4_threaded_ranks_equals_the_single_process_model(name, mesh_name):
    model, args = build(name)
    shape, names = MESHES[mesh_name]
    with fake_world(4, shape, names) as mesh:
        solution = _plan(model, args, mesh)
    # The model is built here, not on the rank threads: transformers' lazy imports are not thread-safe.
    results = run_threaded(4, _rank_step, model, args, mesh_name, solution)
    assert_matches_reference(results, rtol=1e-4, atol=1e-5)
    predicted = predicted_collectives(solution)
    for rank, result in enumerate(results):
        assert result[6] == predicted, f"rank {rank}: compiled {result[6]}, predicted {predicted}"


def hand_and_auto_step_us(name):
    """On a fake 1-D mesh of 4: transformers' own TP plan applied with ``parallelize_module`` and
    dtcompile's plan under the same parameter bytes per rank, input and logits replicated as the
    hand plan has them; each compiled with dtcompile, its forward and backward played under the
    h100 profile.  Returns ``(hand us, auto us, solution, the hand plan's placements by name)``."""
    from torch.distributed.tensor.parallel import parallelize_module

    model, args = build(name)
    plan = hf_tp_plan(model)
    with fake_world(4, (4,), ("tp",)) as mesh:
        hand = copy.deepcopy(model)
        parallelize_module(hand.model, mesh, plan)
        # parallelize_module gives a tied weight (the embedding and the head) one parameter per
        # module: counted once, under the name the user's model gives it.
        names = {n for n, _ in model.named_parameters()}
        hand_params = {n: p for n, p in hand.named_parameters(remove_duplicate=False) if n in names}
        hand_bytes = sum(_local(p).numel() * p.element_size() for p in hand_params.values())
        hand_placements = {n: p.placements if isinstance(p, DTensor) else (Replicate(),) for n, p in hand_params.items()}
        hand_us = step_us(compiled_records(hand, *args))
        solution = _plan(
            model, args, mesh, param_memory_budget_bytes=hand_bytes,
            input_placements=[(Replicate(),)], output_placements=[(Replicate(),)],
        )
        auto = dtcompile.auto_parallel.parallelize(model, solution)
        auto_us = step_us(compiled_records(auto, distribute_tensor(args[0], mesh, [Replicate()], src_data_rank=None)))
    assert solution.param_bytes_per_rank() <= hand_bytes
    return hand_us, auto_us, solution, hand_placements


def _local(p):
    return p.to_local() if isinstance(p, DTensor) else p


@pytest.mark.parametrize("name", ["llama", "phi3", "starcoder2"])
def test_plan_is_no_dearer_than_transformers_own_tp_plan(name):
    hand_us, auto_us, solution, hand_placements = hand_and_auto_step_us(name)
    assert auto_us <= hand_us * (1 + 1e-9), f"{name}: dtcompile's plan {auto_us:.2f} us > HF's plan {hand_us:.2f} us"
    # Where the plans differ, explain() says why the HF placement lost, parameter by parameter.
    differ = [n for n, layout in hand_placements.items() if tuple(layout) != solution.param_placements[n]]
    lines = solution.explain(against=hand_placements).splitlines()
    assert lines[-1] == f"# {len(differ)} of {len(hand_placements)} parameters placed differently"
    assert [line.split(":")[0] for line in lines[:-1]] == differ
    for line in lines[:-1]:
        assert any(why in line for why in ("lost by", "impossible: ", "cheaper alone")), line
