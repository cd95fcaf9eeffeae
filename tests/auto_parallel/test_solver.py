"""The integer program's constraints come in named families, and an infeasible problem says which
of them conflict (an irreducible set), with the fix."""

from __future__ import annotations

import pytest
from torch.distributed.tensor import Replicate

import dtcompile
from dtcompile._testing.models import build_mlp
from dtcompile.auto_parallel.solver import Infeasible, _Program, conflicting_constraints

R = (Replicate(),)


def test_a_budget_below_every_layout_names_the_budget_and_the_least_bytes(tp_mesh):
    reference, _, x = build_mlp(tp_mesh)
    # Pinned replicated, w1.weight alone takes 2048 B per rank; the rest, sharded 4 ways, 560 B.
    with pytest.raises(Infeasible) as info:
        dtcompile.auto_parallel.plan(reference, tp_mesh, (x,), fixed={"w1.weight": R}, param_memory_budget_bytes=1024)
    assert info.value.conflict == ["param_memory_budget_bytes"] and info.value.min_param_bytes == 2608
    assert str(info.value) == (
        "auto_parallel: the solver found no placement (Infeasible); these constraints cannot all hold: "
        "param_memory_budget_bytes. param_memory_budget_bytes=1024: the parameters take at least 2608 B per rank "
        "in any layout they may take (with the pinned ones); loosen the budget or the pinned layouts"
    )


def test_the_conflict_is_irreducible_and_leaves_out_what_can_hold():
    # x0 + x1 = 1 (structural), and three families: "a" wants x0, "b" wants x1, "c" is harmless.
    program = _Program()
    for _ in range(2):
        program.column(0.0, True)
    program.row("one candidate of g", [0, 1], [1.0, 1.0], 1.0, 1.0)
    program.row("a", [0], [1.0], 1.0, 1.0)
    program.row("b", [1], [1.0], 1.0, 1.0)
    program.row("c", [0, 1], [1.0, 1.0], 0.0, 1.0)
    assert conflicting_constraints(program) == ["a", "b"]
    program.rows.pop(2)  # without "b" all holds: no conflict
    assert conflicting_constraints(program) == []


def test_every_row_belongs_to_a_named_family(tp_mesh):
    from dtcompile.auto_parallel import solver

    reference, _, x = build_mlp(tp_mesh)
    solution = dtcompile.auto_parallel.plan(reference, tp_mesh, (x,), param_memory_budget_bytes=1120)
    problem = solution.problem
    program = solver._Program()
    solver._one_choice_per_group(problem, program, problem.groups())
    solver._edge_blocks(problem, program)
    solver._fanout_agreement(problem, program)
    solver._memory_budget(problem, program, 1120)
    families = {row[0].split(" ")[0] for row in program.rows}
    assert families == {"one", "edge", "bucket", "param_memory_budget_bytes"}
    assert len(program.rows) == solution.result.num_constraints
    assert sum(1 for row in program.rows if row[0] == "param_memory_budget_bytes") == 1


def test_collectives_are_priced_as_the_compile_config_buckets_them(tp_mesh):
    from support.ap_cases import KEEP_COLLECTIVES, compiled_records, step_us

    from dtcompile.config import DTCompileConfig

    reference, hand, x = build_mlp(tp_mesh)
    budget = sum(p.to_local().numel() * p.element_size() for p in hand.parameters())
    plans = {}
    # Weights kept gathered (one all-gather each, bucketed): FSDP-like plans beat Megatron here.
    for name, config in {
        "default": DTCompileConfig(reshard_after_forward=False),
        "small buckets": DTCompileConfig(bucket_cap_bytes=4096, reshard_after_forward=False),
        "no bucketing": dtcompile.backend(inductor=False, disable_passes=KEEP_COLLECTIVES, reshard_after_forward=False),
    }.items():
        plans[name] = dtcompile.auto_parallel(
            reference, tp_mesh, (x,), input_placements=[R], output_placements=[R],
            param_memory_budget_bytes=budget, config=config,
        )
    assert plans["default"][1].problem.bucket_cap_bytes == 256 * 1024 * 1024
    assert plans["small buckets"][1].problem.bucket_cap_bytes == 4096
    assert plans["no bucketing"][1].problem.bucket_cap_bytes is None
    assert plans["no bucketing"][1].result.buckets == ()
    # Each estimate is that of the graphs compiled with its config.
    model, solution = plans["no bucketing"]
    kept = {"reshard_after_forward": False}
    assert solution.cost_us == pytest.approx(
        step_us(compiled_records(model, x, disable_passes=KEEP_COLLECTIVES, **kept)), rel=0.01
    )
    model, solution = plans["default"]
    assert solution.cost_us == pytest.approx(step_us(compiled_records(model, x, **kept)), rel=0.01)
    assert plans["no bucketing"][1].cost_us > solution.cost_us  # three launches, not one


def test_the_cost_profile_comes_from_the_compile_config(tp_mesh):
    from dtcompile.config import DTCompileConfig

    reference, _, x = build_mlp(tp_mesh)
    solution = dtcompile.auto_parallel.plan(reference, tp_mesh, (x,), config=DTCompileConfig(cost_profile="a100"))
    assert solution.problem.profile.name == "a100"
    with pytest.raises(ValueError, match=r"cost_profile='h100' but the compile config's cost_profile is 'a100'; give one of them"):
        dtcompile.auto_parallel.plan(reference, tp_mesh, (x,), cost_profile="h100", config=DTCompileConfig(cost_profile="a100"))
    with pytest.raises(TypeError, match="config must be the DTCompileConfig"):
        dtcompile.auto_parallel.plan(reference, tp_mesh, (x,), config={"inductor": False})


@pytest.mark.slow
def test_stats_say_where_planning_took_its_time_and_repeated_layers_are_measured_once(tp_mesh, monkeypatch):
    import collections

    from support.ap_cases import build_block_stack

    from dtcompile.auto_parallel import problem as problem_module

    monkeypatch.setattr(problem_module, "_MEASURE_TABLES", collections.OrderedDict())  # a cold process
    made = {}
    for layers in (2, 3):
        reference, _, x = build_block_stack(tp_mesh, layers)
        stats = dtcompile.auto_parallel.plan(reference, tp_mesh, (x,)).stats
        assert all(stats[f"{stage}_s"] >= 0 for stage in ("trace", "strategies", "measure", "edges", "memory", "solve"))
        assert 0 < stats["candidates_kept"] <= stats["candidates"] and stats["variables"] > 0
        made[layers] = stats["measurements_made"], stats["measurements_reused"]
    # The third layer asks nothing the first two did not: every measurement of the second plan
    # was made by the first.
    assert made[2][0] > 0 and made[3][0] == 0 and made[3][1] > 0
    _, solution = dtcompile.auto_parallel(reference, tp_mesh, (x,))
    assert solution.stats["apply_s"] > 0 and solution.stats["measurements_made"] == 0
