"""Repeated layers share one choice: the problem of a deeper stack of identical layers has no more
choice groups than a shallower one, and every repeated layer gets the same placements."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import Replicate

import dtcompile
from dtcompile._testing.models import MLP

R = (Replicate(),)


def _plan(mesh, layers):
    torch.manual_seed(0)
    model = nn.Sequential(*[MLP(16, 32) for _ in range(layers)])
    x = torch.randn(8, 16)
    replicated = sum(p.numel() * 4 for p in model.parameters())
    return dtcompile.auto_parallel.plan(
        model, mesh, (x,), input_placements=[R], output_placements=[R], param_memory_budget_bytes=replicated // 4
    )


def test_a_deeper_stack_adds_no_choices_and_repeats_the_layer_plan(tp_mesh):
    three, six = _plan(tp_mesh, 3), _plan(tp_mesh, 6)
    assert len(six.problem.nodes) > 1.9 * len(three.problem.nodes)
    assert six.result.num_groups == three.result.num_groups
    assert six.result.num_variables == three.result.num_variables
    placements = six.param_placements
    for layer in range(2, 6):  # layer 0 reads the model's input and may differ
        for name in ("w1.weight", "w1.bias", "w2.weight", "w2.bias"):
            assert placements[f"{layer}.{name}"] == placements[f"1.{name}"]
    # Each copy's cost counts: the deeper stack's estimate grows with it.
    assert six.cost_us > three.cost_us


def test_layers_of_one_op_feeding_each_other_are_not_tied(tp_mesh):
    # blocks.0 and blocks.1 match, but tying them would put both ends of the edge between
    # them into one choice (the plan fuzzer's first find).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(16, 16), nn.LayerNorm(16), nn.LayerNorm(16), nn.Linear(16, 8))
    ids = torch.randint(0, 16, (4, 8))
    solution = dtcompile.auto_parallel.plan(model, tp_mesh, (ids,), param_memory_budget_bytes=1000)
    nodes = solution.problem.nodes
    assert nodes["native_layer_norm"].group != nodes["native_layer_norm_1"].group
    assert solution.param_bytes_per_rank() <= 1000
