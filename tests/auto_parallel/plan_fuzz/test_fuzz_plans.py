"""The plan fuzzer: random small torch.nn models (``support.plan_models``), each planned with random pins and
memory budgets on a random mesh, applied, compiled with dtcompile on threaded ranks and compared with
the single-process model (output and every parameter gradient), its predicted collectives with the
compiled graphs'.  A plan the solver calls infeasible must be so for the reason it names (the budget
below the least bytes the pinned layouts allow).

Plans are made on the fake process group, one at a time; then one threaded world per mesh runs
its whole batch (each rank applies, compiles and steps every model; Dynamo's caches are emptied
between models, every rank waiting).  ``--fuzz-examples N`` / ``--fuzz-seed S`` run more or
elsewhere (the batch in ``CHUNKS`` tests, for pytest-xdist); a failure names its seed,
``test_pinned_finds`` keeps the ones found.
"""

from __future__ import annotations

import copy
import time

import pytest
from support.ap_cases import (
    KEEP_COLLECTIVES,
    KEPT_GATHERED,
    assert_matches_reference,
    assert_same_optimum,
    predicted_collectives,
    step_against_reference,
)
from support.plan_models import MESHES, Case, build, draw_case

import dtcompile
from dtcompile.testing import fake_world, reset_dynamo_on_every_rank, run_threaded

pytestmark = pytest.mark.fuzz

# The CI batch: 48 models (64 before the HF zoo, tests/auto_parallel/hf_zoo, took over part of
# checking the planner on models nobody here wrote; benchmarks/RESULTS.md, "CI at issue #35's code").
CI_EXAMPLES = 48
CHUNKS = 8
CI_SEED = 20261125
SHARES = {"1d2": 0.4, "1d4": 0.3, "2x2": 0.3}


def _plan(case):
    from dtcompile.auto_parallel.solver import Infeasible

    model, args, fixed, budget = build(case)
    shape, names = MESHES[case.mesh]
    with fake_world(shape[0] * (shape[1] if len(shape) > 1 else 1), shape, names) as mesh:
        try:
            solution = dtcompile.auto_parallel.plan(
                model, mesh, args, fixed=fixed, param_memory_budget_bytes=budget, config=KEPT_GATHERED
            )
        except Infeasible as e:
            # Honest only when the budget is below the least bytes the pins allow.
            if e.conflict != ["param_memory_budget_bytes"] or not e.min_param_bytes > budget:
                raise AssertionError(f"{case.describe()}: infeasible for no reason shown: {e}") from e
            return model, args, None, "infeasible"
        except Exception as e:
            raise AssertionError(f"{case.describe()}: planning raised {type(e).__name__}: {e}") from e
    assert_same_optimum(solution)
    return model, args, solution, ""


def _rank_batch(rank, mesh_name, planned):
    from torch.distributed.device_mesh import init_device_mesh

    shape, names = MESHES[mesh_name]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    results = []
    for case, model, args, solution in planned:
        reference = copy.deepcopy(model)
        parallel = dtcompile.auto_parallel.parallelize(reference, solution, mesh)
        try:
            results.append(step_against_reference(rank, parallel, reference, args, mesh, solution, KEEP_COLLECTIVES, reshard=False))
        except Exception as e:
            raise RuntimeError(f"{case.describe()}: {type(e).__name__}: {e}") from e
        reset_dynamo_on_every_rank()
    return results


def run_batch(cases):
    """Plan, apply and compare every case; returns how many were infeasible (for the right reason)."""
    infeasible = 0
    by_mesh = {}
    for case in cases:
        model, args, solution, verdict = _plan(case)
        if verdict == "infeasible":
            infeasible += 1
            continue
        by_mesh.setdefault(case.mesh, []).append((case, model, args, solution))
    for mesh_name, planned in by_mesh.items():
        world_size = 4 if mesh_name != "1d2" else 2
        per_rank = run_threaded(world_size, _rank_batch, mesh_name, planned, timeout=120.0 + 20.0 * len(planned))
        for k, (case, _, _, solution) in enumerate(planned):
            results = [r[k] for r in per_rank]
            try:
                assert_matches_reference(results, rtol=1e-4, atol=1e-5)
                predicted = predicted_collectives(solution)
                assert all(r[6] == predicted for r in results), f"compiled {results[0][6]}, predicted {predicted}"
            except AssertionError as e:
                raise AssertionError(f"{case.describe()}: {e}") from e
    return infeasible


def cases_for(examples, seed):
    cases = []
    for mesh_name, share in SHARES.items():
        count = max(1, round(examples * share))
        cases += [draw_case(seed * 1000 + len(cases) + k, mesh_name) for k in range(count)]
    return cases[:examples] if len(cases) > examples else cases


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_fuzz_plans_compiled_match_the_single_process_model(chunk, fuzz_options, fuzz_report):
    # The batch in CHUNKS tests, so that pytest-xdist's workers share it.
    examples, seed = fuzz_options
    examples = CI_EXAMPLES if examples is None else examples
    seed = CI_SEED if seed is None else seed
    start = time.perf_counter()
    cases = cases_for(examples, seed)[chunk::CHUNKS]
    infeasible = run_batch(cases)
    kinds = sorted({kind for case in cases for kind, _, _ in case.blocks})
    fuzz_report(
        f"plan fuzzer, chunk {chunk + 1} of {CHUNKS}: {len(cases)} models (seed {seed}) in "
        f"{time.perf_counter() - start:.0f} s: {len(cases) - infeasible} planned, compiled and equal to the "
        f"single-process model, {infeasible} infeasible for their budget; blocks drawn: {', '.join(kinds)}"
    )
    # A batch the planner found nothing for tested nothing.
    assert infeasible < len(cases), f"chunk {chunk}: every one of its {len(cases)} models was infeasible"


# Finds of the fuzzer, each a bug fixed since: the case the failure named (kept as data: a seed
# draws another model once the catalogue grows).
PINNED = {
    # Two LayerNorms in a row in an nn.Sequential: tied as repeated layers, both ends of the
    # edge between them in one choice group (an AssertionError in the solver).
    "tied_layernorms": Case(1008, "1d2", (("norm", "layer", 32), ("norm", "layer", 16), ("residual_mlp", "", 8)),
                            embed=True, dim=16),
    # nn.RMSNorm's eps added in place to an intermediate: refused as if it wrote a buffer.
    "rmsnorm_eps_in_place": Case(1005, "1d2", (("sdpa", "causal", 16), ("norm", "rms", 32), ("linear", "nobias", 8),
                                               ("linear", "bias", 16)), embed=True, dim=16, budget_share=4),
    # A model of activations only: nothing to differentiate (the generator's bug).
    "activations_only": Case(1079, "1d4", (("activation", "softmax", 16), ("linear", "bias", 16)), embed=False, dim=16,
                             budget_share=4),
}


@pytest.mark.parametrize("name", list(PINNED))
def test_pinned_finds(name):
    run_batch([PINNED[name]])  # raises on a failure (an infeasible plan must be honestly so)
