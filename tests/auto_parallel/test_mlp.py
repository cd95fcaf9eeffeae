"""Auto-parallel on the tensor parallel MLP (1-D mesh of 4, fake process group): the plan, its
explanation, its collectives against the compiled graphs', and its cost against the hand plan's."""

from __future__ import annotations

import pytest
from expecttest import assert_expected_inline
from support.ap_cases import KEEP_COLLECTIVES, compiled_collectives, compiled_records, predicted_collectives, step_us
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

import dtcompile
from dtcompile._testing.models import build_mlp
from dtcompile.base.channels import Artifact

R = (Replicate(),)


@pytest.fixture
def mlp(tp_mesh):
    reference, hand, x = build_mlp(tp_mesh)
    hand_bytes = sum(p.to_local().numel() * p.element_size() for p in hand.parameters())
    return tp_mesh, reference, hand, x, hand_bytes


def _plan(mlp, **options):
    mesh, reference, _, x, _ = mlp
    return dtcompile.auto_parallel(reference, mesh, (x,), input_placements=[R], output_placements=[R], **options)


def test_without_a_budget_a_tiny_mlp_stays_replicated(mlp):
    # Compute is nanoseconds, any collective ~8 us: no communication is the best plan.
    _, solution = _plan(mlp)
    assert set(solution.param_placements.values()) == {R}
    assert solution.predicted_collectives() == []


def test_explain_under_the_hand_plans_memory(mlp):
    # One bucketed all-gather of every parameter (~8.4 us) beats the Megatron plan's
    # all-reduce (~10.2 us) at this size: the solver knows dtcompile buckets parameter collectives.
    _, solution = _plan(mlp, param_memory_budget_bytes=mlp[4])
    assert_expected_inline(solution.explain(), """\
w1.weight = param(float32[32, 16])  # placement=() -> S(0), cost=[0.00]
w1.bias = param(float32[32])  # placement=() -> S(0), cost=[0.00]
w2.weight = param(float32[16, 32])  # placement=() -> S(1), cost=[0.00]
w2.bias = param(float32[16])  # placement=() -> R, cost=[0.00]
input0 = input(float32[4, 16])  # placement=() -> R, cost=[0.00]
t = aten.t(w1.weight)  # placement=(S(0)) -> S(1), cost=[0.00, 0.00]
addmm = aten.addmm(w1.bias, input0, t)  # placement=(S(0), R, S(1)) -> S(1), cost=[0.00, 0.00, 0.00, 0.00]
gelu = aten.gelu(addmm)  # placement=(S(1)) -> S(1), cost=[0.00, 0.00]
t_1 = aten.t(w2.weight)  # placement=(S(1)) -> S(0), cost=[0.00, 0.00]
addmm_1 = aten.addmm(w2.bias, gelu, t_1)  # placement=(R, S(1), S(0)) -> P(sum), cost=[0.00, 0.00, 0.00, 0.00]
output0 = output(addmm_1)  # placement=(R) -> R, cost=[0.00, 10.20]
# estimated step: 10.20 us (h100); parameters 1120 B per rank
# estimated peak: 3.44 KiB per rank at the end of the backward (parameters 1.09 KiB, inputs 256 B, gradients 1.09 KiB, backward working set 1 KiB)""")


def test_explain_one_node_lists_the_alternatives_and_why_they_lost(mlp):
    _, solution = _plan(mlp, param_memory_budget_bytes=mlp[4])
    assert_expected_inline(solution.explain("addmm_1"), """\
addmm_1 = aten.addmm(w2.bias, gelu, t_1)  # placement=(R, S(1), S(0)) -> P(sum), cost=[0.00, 0.00, 0.00, 0.00]
# 4 candidates; cost around it with the neighbours' choices kept:
  (R, R, R) -> R                           25.210 us  lost by 15.009 us
  (R, S(1), S(0)) -> P(sum)                10.201 us  chosen
  (R, S(0), R) -> S(0)                     50.416 us  lost by 40.215 us
  (S(0), R, S(1)) -> S(1)                  50.418 us  lost by 40.217 us""")
    # Gathering a weight sharded on dim 1 needs a cat afterwards: a few bytes more to move.
    assert_expected_inline(solution.explain("w2.weight"), """\
w2.weight = param(float32[16, 32])  # placement=() -> S(1), cost=[0.00]
# 3 candidates; cost around it with the neighbours' choices kept:
  () -> R                                  impossible: parameters would take 2656 B per rank, over the budget of 1120 B
  () -> S(0)                               8.415 us  lost by 8.415 us
  () -> S(1)                               0.000 us  chosen""")


def test_a_budget_below_the_replicated_size_shards_the_parameters_within_it(mlp):
    replicated = sum(p.numel() * p.element_size() for p in mlp[1].parameters())
    budget = replicated // 3
    model, solution = _plan(mlp, param_memory_budget_bytes=budget)
    held = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    assert held == solution.param_bytes_per_rank() <= budget < replicated
    assert any(isinstance(p, Shard) for layout in solution.param_placements.values() for p in layout)
    assert all(isinstance(p, DTensor) for p in model.parameters())


def test_cost_is_no_higher_than_the_hand_plan_on_the_compiled_graphs(mlp):
    mesh, _, hand, x, hand_bytes = mlp
    model, solution = _plan(mlp, param_memory_budget_bytes=hand_bytes)
    auto_us, hand_us = step_us(compiled_records(model, x)), step_us(compiled_records(hand, x))
    assert auto_us <= hand_us
    assert solution.cost_us == pytest.approx(auto_us, rel=0.01)


def test_predicted_collectives_equal_the_compiled_ones(mlp):
    model, solution = _plan(mlp, param_memory_budget_bytes=mlp[4])
    compiled = compiled_collectives(compiled_records(model, mlp[3], disable_passes=KEEP_COLLECTIVES))
    assert predicted_collectives(solution) == compiled
    # Megatron's one all-reduce: gathering the weights (~8.4 us) would gather them again in
    # the backward (reshard after forward), ~16.8 us in all.
    assert compiled == {("forward", "all_reduce", "tp", 256): 1}


def test_kept_gathered_weights_are_gathered_once(mlp):
    mesh, reference, _, x, budget = mlp
    config = dtcompile.DTCompileConfig(inductor=False, reshard_after_forward=False)
    model, solution = dtcompile.auto_parallel(
        reference, mesh, (x,), input_placements=[R], output_placements=[R], param_memory_budget_bytes=budget,
        config=config,
    )
    # Without the backward's gathers one bucketed all-gather (~8.4 us) beats the all-reduce (~10.2 us).
    compiled = compiled_collectives(compiled_records(model, x, disable_passes=KEEP_COLLECTIVES, reshard_after_forward=False))
    assert predicted_collectives(solution) == compiled
    assert compiled == {("forward", "all_gather", "tp", 2048): 2, ("forward", "all_gather", "tp", 128): 1}


MEGATRON = {"w1.weight": (Shard(0),), "w1.bias": (Shard(0),), "w2.weight": (Shard(1),), "w2.bias": R}


def test_pinned_parameters_keep_their_placements_and_collectives_still_match(mlp):
    model, solution = _plan(mlp, fixed=MEGATRON)
    assert solution.param_placements == MEGATRON
    assert {n: p.placements for n, p in model.named_parameters()} == MEGATRON
    compiled = compiled_collectives(compiled_records(model, mlp[3], disable_passes=KEEP_COLLECTIVES))
    assert predicted_collectives(solution) == compiled


def test_spmd_types_by_axis_name_pin_as_their_placements_do(mlp):
    """Pins, inputs and outputs written as SPMD types per mesh axis name (``S(d)``, ``R``/``I``)
    plan as the placements they name: the same plan, the same parameters."""
    typed = {name: {"tp": f"S({p[0].dim})" if isinstance(p[0], Shard) else "I"} for name, p in MEGATRON.items()}
    mesh, reference, _, x, _ = mlp
    by_types = dtcompile.auto_parallel(reference, mesh, (x,), input_placements=[{"tp": "R"}], output_placements=[{"tp": "R"}],
                                       fixed=typed)[1]
    by_placements = _plan(mlp, fixed=MEGATRON)[1]
    assert by_types.param_placements == by_placements.param_placements == MEGATRON
    assert by_types.input_placements == by_placements.input_placements
    assert by_types.cost_us == pytest.approx(by_placements.cost_us, rel=1e-9)
    with pytest.raises(ValueError, match=r"input_placements\[0\] = \{'dp': 'R'\}: \['dp'\] are not axes of the mesh"):
        dtcompile.auto_parallel(reference, mesh, (x,), input_placements=[{"dp": "R"}])
    with pytest.raises(ValueError, match="a pinned layout cannot be Partial"):
        dtcompile.auto_parallel(reference, mesh, (x,), output_placements=[{"tp": "P"}])


def test_arguments_are_checked_with_the_fix_in_the_message(mlp):
    mesh, reference, _, x, _ = mlp
    with pytest.raises(ValueError, match=r"fixed names 'w3.weight', which is neither a parameter"):
        dtcompile.auto_parallel(reference, mesh, (x,), fixed={"w3.weight": R})
    with pytest.raises(ValueError, match=r"input_placements\[0\] has 2 placements for a 1-D mesh"):
        dtcompile.auto_parallel(reference, mesh, (x,), input_placements=[(Replicate(), Replicate())])
    with pytest.raises(ValueError, match="a pinned layout cannot be Partial"):
        dtcompile.auto_parallel(reference, mesh, (x,), output_placements=[(Partial(),)])
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        dtcompile.auto_parallel(lambda t: t, mesh, (x,))
    with pytest.raises(ValueError, match="param_memory_budget_bytes must be an int >= 0"):
        dtcompile.auto_parallel(reference, mesh, (x,), param_memory_budget_bytes=-1)
    with pytest.raises(ValueError, match="the solver found no placement"):
        dtcompile.auto_parallel(reference, mesh, (x,), param_memory_budget_bytes=16)


def test_without_highspy_the_error_says_how_to_install_it(mlp, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "highspy", None)
    mesh, reference, _, x, _ = mlp
    with pytest.raises(ImportError, match=r"pip install 'dtcompile\[autoparallel\]'"):
        dtcompile.auto_parallel(reference, mesh, (x,))


def test_the_solution_is_logged_for_tlparse(mlp, monkeypatch):
    import torch

    logged = []
    monkeypatch.setattr(
        torch._logging, "trace_structured",
        lambda kind, metadata_fn, payload_fn: logged.append((kind, metadata_fn()["name"], payload_fn())),
    )
    _, solution = _plan(mlp)
    assert logged == [("artifact", Artifact.AUTO_PARALLEL_SOLUTION, solution.explain())]


def test_explain_of_the_applied_model_starts_with_its_solution(mlp):
    from torch.distributed.tensor import distribute_tensor

    mesh, _, _, x, _ = mlp
    model, solution = _plan(mlp, param_memory_budget_bytes=mlp[4])
    report = dtcompile.explain(model)(distribute_tensor(x, mesh, R, src_data_rank=None))
    assert report.solution == solution.explain()
    text = report.text(aot_graphs=False)
    assert text.index("== auto-parallel solution ==\n" + solution.explain()) < text.index("== compile 0/0 ==")


@pytest.mark.subprocess
def test_importing_the_package_registers_nothing_and_it_is_callable():
    import subprocess
    import sys

    code = (
        "import torch, dtcompile.auto_parallel as ap, dtcompile; "
        "assert not hasattr(torch.ops.dtcompile_autoparallel, 'region'); "
        "assert callable(dtcompile.auto_parallel) and dtcompile.auto_parallel is ap; "
        "assert ap.plan.__module__ == 'dtcompile.auto_parallel.api'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_buffer_is_replicated_and_the_model_runs_eagerly(tp_mesh):
    import torch
    from torch import nn

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(16, 16)
            self.register_buffer("scale", torch.full((16,), 2.0))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) * self.scale

    torch.manual_seed(0)
    reference, x = Scaled(), torch.randn(4, 16)
    model, solution = dtcompile.auto_parallel(reference, tp_mesh, (x,), input_placements=[R], output_placements=[R])
    scale = next(n for n in solution.problem.nodes.values() if n.target == "scale")
    assert [c.outputs[0] for c in scale.candidates] == [R]
    out = model(x)  # eagerly, on the fake process group
    assert isinstance(out, DTensor) and out.placements == R and out.shape == (4, 16)


@pytest.mark.inductor
def test_the_planned_mlp_compiles_with_inductor(mlp):
    import torch

    model, solution = _plan(mlp, param_memory_budget_bytes=mlp[4])
    torch._dynamo.reset()
    out = torch.compile(model, backend="dtcompile", fullgraph=True)(mlp[3])
    assert out.placements == R and out.shape == (4, 16)
    out.to_local().sum().backward()
    assert all(p.grad is not None and p.grad.placements == p.placements for p in model.parameters())
