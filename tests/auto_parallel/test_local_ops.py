"""Every op can be planned: an op DTensor has no strategy for runs on local shards, with a twin's
strategies (the CPU flash attention) or replicated on every rank (any other op); the explanation
names each such node, and what still cannot be planned is an error naming node, op and fix."""

from __future__ import annotations

import copy
import inspect
import re

import pytest
import torch
from support.ap_cases import (
    KEEP_COLLECTIVES,
    assert_matches_reference,
    predicted_collectives,
    sharded_budget,
    step_against_reference,
)
from torch import nn
from torch.distributed.tensor import Replicate, Shard

import dtcompile
from dtcompile.testing import fake_world, run_threaded


@torch.library.custom_op("dtcompile_ap_test::softclip", mutates_args=())
def softclip(x: torch.Tensor) -> torch.Tensor:
    """An op DTensor has no strategy for: ``2 tanh(x / 2)``."""
    return 2 * torch.tanh(x / 2)


@softclip.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _softclip_backward(ctx, grad):
    (x,) = ctx.saved_tensors
    return grad * (1 - torch.tanh(x / 2) ** 2)


softclip.register_autograd(_softclip_backward, setup_context=lambda ctx, inputs, output: ctx.save_for_backward(inputs[0]))


@torch.library.custom_op("dtcompile_ap_test::no_backward", mutates_args=())
def no_backward(x: torch.Tensor) -> torch.Tensor:
    """An op with no strategy and no autograd formula: nothing can plan it."""
    return x.clone()


@no_backward.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class Clipped(nn.Module):
    op = softclip  # a class attribute: deepcopy leaves it alone

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.op(self.up(x)))


class Unplannable(Clipped):
    op = no_backward


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 4, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x, x, x, need_weights=False)[0]


def _build(cls, *shape):
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return cls(), torch.randn(*shape)


@pytest.mark.models
def test_cpu_flash_attention_is_planned_with_the_efficient_attention_strategies(tp_mesh):
    model, x = _build(Attention, 4, 8, 16)
    solution = dtcompile.auto_parallel.plan(model, tp_mesh, (x,), param_memory_budget_bytes=sharded_budget(model, 2))
    (name,) = solution.local_nodes
    assert solution.local_nodes == {name: "borrowed"}
    node = solution.problem.nodes[name]
    assert node.target == "aten._scaled_dot_product_flash_attention_for_cpu"
    # Replicated, batch-sharded and head-sharded, as DTensor lists the twin's; never the sequence.
    q_layouts = {c.inputs[0] for c in node.candidates}
    assert q_layouts == {(Replicate(),), (Shard(0),), (Shard(1),)}
    assert all(c.local == "borrowed" and c.inputs[0] == c.outputs[0] for c in node.candidates)
    explained = solution.explain()
    assert "runs on local shards (borrowed)" in next(line for line in explained.splitlines() if line.startswith(name))
    assert (
        f"# {name} (aten._scaled_dot_product_flash_attention_for_cpu) has no DTensor strategy: "
        "planned with its twin's, run on local shards" in explained
    )


def test_an_op_without_any_strategy_falls_back_to_replicated(tp_mesh):
    model, x = _build(Clipped, 4, 16)
    solution = dtcompile.auto_parallel.plan(model, tp_mesh, (x,), param_memory_budget_bytes=sharded_budget(model, 2))
    assert solution.local_nodes == {"softclip": "replicated"}
    (candidate,) = solution.problem.nodes["softclip"].candidates
    assert candidate.inputs == candidate.outputs == ((Replicate(),),)
    assert candidate.forward_us > 0 and candidate.backward_us > 0  # its whole compute, measured
    assert "# softclip (dtcompile_ap_test.softclip) has no DTensor strategy: its inputs replicated, run whole on every rank" in (
        solution.explain()
    )


@pytest.mark.models
def test_an_op_with_a_decomposition_is_planned_as_its_decomposition(tp_mesh):
    from support.zoo_models import GLUHead

    torch.manual_seed(0)
    model, x = GLUHead(), torch.randn(4, 8, 16)
    # A third of the replicated parameter bytes: up's weight must be sharded.
    solution = dtcompile.auto_parallel.plan(model, tp_mesh, (x, x.clone()), param_memory_budget_bytes=sharded_budget(model, 3))
    assert solution.local_nodes == {}
    decomposed = solution.decomposed
    assert set(decomposed) == {"aten.glu", "aten.hardswish", "aten._prelu_kernel", "aten.mse_loss"}
    traced_ops = {n.target for n in solution.problem.traced.gm.graph.nodes if n.op == "call_function"}
    assert not {torch.ops.aten.glu.default, torch.ops.aten.mse_loss.default} & traced_ops
    assert {solution.problem.nodes[n].target for n in decomposed["aten.glu"]} == {"aten.slice", "aten.sigmoid", "aten.mul"}
    # Unlike the replicated fallback, each node of the decomposition may run sharded.
    for name in decomposed["aten.glu"]:
        assert any(isinstance(c.outputs[0][0], Shard) for c in solution.problem.nodes[name].candidates), name
    assert (
        f"# aten.glu has no DTensor strategy: planned as its decomposition ({', '.join(decomposed['aten.glu'])})"
        in solution.explain()
    )


def test_an_op_nothing_can_run_is_an_error_naming_node_op_and_fix(tp_mesh):
    model, x = _build(Unplannable, 4, 16)
    with pytest.raises(ValueError) as info:
        dtcompile.auto_parallel.plan(model, tp_mesh, (x,))
    message = str(info.value)
    line = inspect.getsourcelines(Clipped.forward)[1] + 1  # the line of the model's code that calls it
    assert message.startswith(
        f"auto_parallel: node no_backward (dtcompile_ap_test.no_backward, at {__file__}:{line} in forward: "
        "`return self.down(self.op(self.up(x)))`) cannot be planned: "
    ), message
    assert "run whole on every rank it fails (RuntimeError: " in message
    assert message.endswith(
        "pin the parameters and inputs around it with fixed=..., or wrap the code that calls it in "
        "dtcompile.local_map with the placements it needs"
    )


def test_a_malformed_edge_is_an_error_naming_its_nodes():
    from dtcompile.auto_parallel.edges import _checked
    from dtcompile.auto_parallel.graph import Candidate, Edge, PNode

    def node(name, count):
        return PNode(name, "op", [], [((4,), torch.float32)], [True], [Candidate((), ((Replicate(),),))] * count, target="aten.mm")

    with pytest.raises(ValueError, match=r"the edge a -> b \(argument 0\): its cost matrix is \(2, \[1\]\), not \(2, 3\)"):
        _checked(Edge("a", 0, "b", 0, [[0.0], [0.0]]), node("a", 2), node("b", 3))
    with pytest.raises(ValueError, match=r"the edge a -> b \(argument 0\): node a \(aten.mm\) has no candidate strategy"):
        _checked(Edge("a", 0, "b", 0, []), node("a", 0), node("b", 3))
    with pytest.raises(ValueError, match=r"the edge a -> b \(argument 0\): no layout a can give"):
        _checked(Edge("a", 0, "b", 0, [[float("inf")]]), node("a", 1), node("b", 1))


def _rank_step(rank, reference, x, solution):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    reference = copy.deepcopy(reference)
    model = dtcompile.auto_parallel.parallelize(reference, solution, mesh)
    return step_against_reference(rank, model, reference, x, mesh, solution, KEEP_COLLECTIVES)


@pytest.mark.models
@pytest.mark.parametrize("how", ["replicated", "borrowed"])
def test_ops_run_on_local_shards_equal_the_single_process_model_on_4_threaded_ranks(how):
    if how == "replicated":
        model, x = _build(Clipped, 4, 16)
        options = {"param_memory_budget_bytes": sharded_budget(model, 2)}
    else:  # the batch sharded, the causal mask read whole
        from support.zoo_models import build

        model, (x,) = build("causal_sdpa")
        options = {"input_placements": [(Shard(0),)], "output_placements": [(Shard(0),)]}
    with fake_world(4, (4,), ("tp",)) as mesh:
        solution = dtcompile.auto_parallel.plan(model, mesh, (x,), **options)
    ((name, found),) = solution.local_nodes.items()
    assert found == how
    expected = ((Replicate(),),) if how == "replicated" else ((Shard(0),),) * 3 + ((Replicate(),),)
    assert solution.choice(name).inputs == expected
    results = run_threaded(4, _rank_step, model, x, solution)
    assert_matches_reference(results)
    assert all(r[6] == predicted_collectives(solution) for r in results)


def test_ops_with_dtensor_strategies_are_not_planned_locally(tp_mesh):
    # Ops DTensor has strategies for stay DTensor's: nothing else is planned locally.
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model, x = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.LayerNorm(16)), torch.randn(4, 16)
    solution = dtcompile.auto_parallel.plan(model, tp_mesh, (x,))
    assert solution.local_nodes == {}
    assert "runs on local shards" not in solution.explain()


class InPlaceOnInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x.view(4, 16).mul_(2))


def test_an_in_place_write_to_a_buffer_or_input_is_refused_not_lost(tp_mesh):
    # The parallel model reads each of them through its own redistributed copy: a write would be lost.
    with torch.random.fork_rng():
        torch.manual_seed(0)
        x = torch.randn(4, 16)
        norm = nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16))  # training: running statistics
    with pytest.raises(ValueError, match=r"^auto_parallel: node add_ \(aten.add_[^)]*\) writes to 1.num_batches_tracked in place, "):
        dtcompile.auto_parallel.plan(norm, tp_mesh, (x,))
    # The message names the line of the model's code that wrote.
    line = inspect.getsourcelines(InPlaceOnInput.forward)[1] + 1
    with pytest.raises(ValueError, match=(
        r"^auto_parallel: node mul_ \(aten.mul_, at " + re.escape(f"{__file__}:{line} in forward: ")
        + r"`return self.proj\(x.view\(4, 16\).mul_\(2\)\)`\) writes to input0 in place, "
    )):
        dtcompile.auto_parallel.plan(InPlaceOnInput(), tp_mesh, (x,))
    assert dtcompile.auto_parallel.plan(norm.eval(), tp_mesh, (x,)).local_nodes == {}  # reads its statistics only


@pytest.mark.models
def test_an_in_place_op_on_a_computed_value_is_planned_and_equals_the_single_process_model():
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model, x = nn.Sequential(nn.Linear(16, 32), nn.ReLU(inplace=True), nn.Linear(32, 16)), torch.randn(4, 16)
    with fake_world(4, (4,), ("tp",)) as mesh:
        solution = dtcompile.auto_parallel.plan(model, mesh, (x,), param_memory_budget_bytes=sharded_budget(model, 2))
    assert any(n.target == "aten.relu_" for n in solution.problem.nodes.values())
    results = run_threaded(4, _rank_step, model, x, solution)
    assert_matches_reference(results)


class ConstantsInForward(nn.Module):
    """Tensors made in ``forward`` (traced as lifted constants): a scale and an index."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x) * torch.tensor([0.5, 2.0, 1.0, 3.0] * 4)
        return y.index_select(-1, torch.tensor([3, 2, 1, 0] * 4))


def _compiled_rank_step(rank, model, x, solution):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    parallel = dtcompile.auto_parallel.parallelize(copy.deepcopy(model), solution, mesh)
    compiled = torch.compile(parallel, backend=dtcompile.backend(inductor=False), fullgraph=True)
    out = compiled(distribute_tensor(x, mesh, solution.input_placements[0], src_data_rank=None)).full_tensor()
    out.pow(2).sum().backward()
    return out.detach(), {n: p.grad.full_tensor() for n, p in parallel.named_parameters()}


def test_tensors_made_in_forward_are_planned_replicated_and_equal_the_single_process_model():
    # Once refused ("reads the tensor attribute _tensor_constant0; make it a buffer"): the user
    # cannot make a buffer of a tensor a library builds inside forward (transformers' Falcon does).
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model, x = ConstantsInForward(), torch.randn(4, 16)
    with fake_world(4, (4,), ("tp",)) as mesh:
        solution = dtcompile.auto_parallel.plan(model, mesh, (x,))
    constants = [n for n in solution.problem.nodes.values() if n.fx_node is not None and n.fx_node.op == "get_attr"]
    assert len(constants) == 2 and all(n.kind == "constant" for n in constants)
    expected = model(x)
    expected.pow(2).sum().backward()
    for out, grads in run_threaded(4, _compiled_rank_step, model, x, solution):
        torch.testing.assert_close(out, expected.detach())
        for name, p in model.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, msg=lambda m, n=name: f"grad of {n}: {m}")
