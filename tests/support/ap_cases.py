"""What the auto-parallel tests share: the step cost of a compiled program, and collectives as multisets.

The solution and the hand-written plans are compared the same way: each model is
compiled with dtcompile (``inductor=False``: the same AOT graphs and passes),
run forward and backward once, and every compiled graph is played by
:func:`dtcompile.cost.simulate.simulate` under one hardware profile.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.distributed.tensor import Replicate, Shard

import dtcompile
from dtcompile._testing import models
from dtcompile._testing.cases import CASES
from dtcompile.config import DTCompileConfig
from dtcompile.cost import get_profile
from dtcompile.cost.simulate import simulate
from dtcompile.report import backward_from_sum

# Passes that merge collectives: off when the compiled collectives are compared one
# by one with the predicted ones (bucketing merges several into one).
KEEP_COLLECTIVES = frozenset({"bucketing"})

# The solver's bucket model is bucket_cap_bytes alone (see dtcompile.auto_parallel's
# limits): its plans are compiled with a memory budget that does not split buckets.
UNBOUNDED_MEMORY = 1 << 40

# The config the zoo and the plan fuzzer plan and compile with: gathered weights kept.
# Their programs' predicted collectives are compared exactly with the compiled ones,
# and the backward's re-gathers of resharded weights are predicted from each op's
# measured backward, which for some decompositions reads other inputs than the
# compiled graph does (docs/limits.md); test_mlp checks the re-gathers predicted.
KEPT_GATHERED = DTCompileConfig(reshard_after_forward=False, memory_budget_bytes=UNBOUNDED_MEMORY)


def compiled_records(model: Any, *args: Any, disable_passes: frozenset[str] = frozenset(), **options: Any) -> list[Any]:
    """Compile ``model`` with dtcompile (``options`` for the backend), run one forward and
    backward, return the graphs' records."""
    torch._dynamo.reset()
    options.setdefault("memory_budget_bytes", UNBOUNDED_MEMORY)
    backend = dtcompile.backend(inductor=False, disable_passes=set(disable_passes), **options)
    out = torch.compile(model, backend=backend, fullgraph=True)(*args)
    backward_from_sum(out)
    return list(backend.records)


def step_us(records: list[Any], profile: str = "h100") -> float:
    """Estimated time of the compiled forward and backward graphs, end to end."""
    hw = get_profile(profile)
    return sum(simulate(r.graph.graph, hw).total_us for r in records)


def compiled_collectives(records: list[Any]) -> Counter:
    """``(direction, op, axis, bytes)`` of every collective the compiled graphs issue."""
    return Counter(
        ("backward" if r.kind == "backward" else "forward", c.op, c.axis, c.bytes) for r in records for c in r.collectives
    )


def predicted_collectives(solution: Any) -> Counter:
    return Counter(c.key() for c in solution.predicted_collectives())


BUILDS = {
    "mlp": models.build_mlp,
    # The MLP for a 2-D (dp, tp) mesh: its hand plan (unused here) is tensor parallel over tp.
    "mlp_2d": lambda mesh: models.build_mlp(mesh["tp"]),
    "block": models.build_block,
    "fsdp_mlp": models.build_fsdp_mlp,
    "block_2d": models.build_block_2d,
    "block_local_map": models.build_block_local_map,
}


def step_against_reference(
    rank: int, model: Any, reference: Any, args: Any, mesh: Any, solution: Any,
    disable_passes: frozenset[str] = frozenset(), inductor: bool = False, reshard: bool = True,
) -> tuple[Any, ...]:
    """One compiled step of the applied ``model`` and the same step of ``reference`` (loss: the
    sum of each output's ``pow(2).mean()``): both outputs and gradients (full tensors), the
    number of compiled graphs, the parameter layouts, the compiled graphs' collectives.
    ``args``: one input tensor, or a tuple of them.  Checks first that the applied model names
    every parameter and buffer as ``reference`` does."""
    from torch.distributed.tensor import distribute_tensor
    from torch.utils import _pytree as pytree

    names = [n for n, _ in model.named_parameters()], [n for n, _ in model.named_buffers()]
    assert names == ([n for n, _ in reference.named_parameters()], [n for n, _ in reference.named_buffers()]), (
        f"rank {rank}: the parallel model's names {names} are not the reference's"
    )
    assert list(model.state_dict()) == list(reference.state_dict())
    args = args if isinstance(args, tuple) else (args,)
    local = [
        distribute_tensor(x, mesh, layout, src_data_rank=None)
        for x, layout in zip(pytree.tree_leaves(args), solution.input_placements)
    ]
    backend = dtcompile.backend(
        inductor=inductor, disable_passes=set(disable_passes), memory_budget_bytes=UNBOUNDED_MEMORY, reshard_after_forward=reshard
    )
    outs = pytree.tree_leaves(torch.compile(model, backend=backend, fullgraph=True)(*local))
    outs = [o.full_tensor() for o in outs]
    sum(o.pow(2).mean() for o in outs if o.is_floating_point()).backward()
    # A parameter's gradient comes back in the parameter's own placements.
    for name, p in model.named_parameters():
        if p.grad is not None:
            assert p.grad.placements == p.placements, f"rank {rank}: grad of {name} is {p.grad.placements}, not {p.placements}"
    grads = {name: p.grad.full_tensor() if p.grad is not None else None for name, p in model.named_parameters()}
    ref_outs = pytree.tree_leaves(reference(*args))
    sum(o.pow(2).mean() for o in ref_outs if o.is_floating_point()).backward()
    ref_grads = {name: p.grad for name, p in reference.named_parameters()}
    out = outs[0] if len(outs) == 1 else tuple(outs)
    ref_out = ref_outs[0] if len(ref_outs) == 1 else tuple(ref_outs)
    collectives = compiled_collectives(list(backend.records))
    return (
        detached(out), grads, detached(ref_out), ref_grads, len(backend.records), solution.param_placements, collectives,
    )


def assert_same_optimum(solution: Any) -> None:
    """The solver's reduced program (dominated candidates removed, one bucket row per edge block,
    presolve off) reached the optimum of the plain one (every candidate, a bucket row per pair)."""
    from dtcompile.auto_parallel.solver import solve

    plain = solve(solution.problem, param_memory_budget_bytes=solution.param_memory_budget_bytes, reduced=False)
    reduced = solution.result.objective_us
    assert abs(plain.objective_us - reduced) <= 1e-6 * max(1.0, abs(plain.objective_us)), (plain.objective_us, reduced)


def sharded_budget(model: Any, ways: int = 2) -> int:
    """The model's replicated parameter bytes over ``ways``: under it the solver must shard."""
    return sum(p.numel() * p.element_size() for p in model.parameters()) // ways


def apply_and_step(
    rank: int, reference: Any, args: Any, shape: tuple[int, ...], names: tuple[str, ...], solution: Any
) -> tuple[Any, ...]:
    """On this rank's CPU mesh of ``shape`` and axis ``names``: a copy of ``reference`` (each
    rank's own: gradients accumulate on it) parallelized as ``solution`` chose, and one compiled
    step of it against the copy (:func:`step_against_reference`), collectives unmerged and
    gathered weights kept, as the zoos plan (``KEPT_GATHERED``)."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    reference = copy.deepcopy(reference)
    model = dtcompile.auto_parallel.parallelize(reference, solution, mesh)
    return step_against_reference(rank, model, reference, args, mesh, solution, KEEP_COLLECTIVES, reshard=False)


def detached(value: Any) -> Any:
    return tuple(v.detach() for v in value) if isinstance(value, tuple) else value.detach()


def _step_against_reference(rank: int, model: Any, reference: Any, x: Any, mesh: Any, solution: Any) -> tuple[Any, ...]:
    return step_against_reference(rank, model, reference, x, mesh, solution)


def rank_step(
    rank: int,
    build: str,
    mesh_shape: tuple[int, ...],
    names: tuple[str, ...],
    input_layouts: list[Any] | None,
    output_layouts: list[Any] | None,
    budget: int | None,
) -> tuple[Any, ...]:
    """On one rank: plan the shared model ``build``, compile it with dtcompile, one step
    (loss ``out.pow(2).mean()`` of the whole output); the same step on the single-process
    model.  Returns both outputs and gradients (full tensors), and the solution's layouts."""
    from torch.distributed.device_mesh import init_device_mesh

    from dtcompile.auto_parallel.apply import parallelize

    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    reference, _, x = BUILDS[build](mesh)
    solution = dtcompile.auto_parallel.plan(
        reference, mesh, (x,), input_placements=input_layouts, output_placements=output_layouts,
        param_memory_budget_bytes=budget,
    )
    return _step_against_reference(rank, parallelize(reference, solution), reference, x, mesh, solution)


def assert_matches_reference(results: list[tuple[Any, ...]], rtol: float = 1e-5, atol: float = 1e-5) -> None:
    for rank, (out, grads, ref_out, ref_grads, num_graphs, *_) in enumerate(results):
        assert num_graphs >= 2, f"rank {rank}: dtcompile compiled {num_graphs} graphs"
        torch.testing.assert_close(out, ref_out, rtol=rtol, atol=atol, msg=lambda m, r=rank: f"rank {r}, output: {m}")
        assert grads.keys() == ref_grads.keys()
        assert any(g is not None for g in grads.values()), f"rank {rank}: no parameter got a gradient"
        for name, grad in grads.items():
            torch.testing.assert_close(
                grad, ref_grads[name], rtol=rtol, atol=atol, msg=lambda m, r=rank, n=name: f"rank {r}, grad of {n}: {m}"
            )
    placements = [r[5] for r in results]
    assert all(p == placements[0] for p in placements), f"ranks planned differently: {placements}"


# Per case of dtcompile._testing.cases: the layout of its input and output, as the hand plan has them.
BOUNDARY = {
    "tp_mlp": (Replicate(),),
    "tp_sp_block": (Replicate(),),
    "tp_sp_block_local_map": (Replicate(),),
    "fsdp_mlp": (Shard(0),),
    "block_2d": (Shard(0), Replicate()),
}


def plan_case(case_name: str, mesh: Any, **options: Any) -> tuple[Any, Any, Any, Any, int]:
    """On a fake world's ``mesh``: the case's reference, hand-parallel model and input, and
    the solution under the hand plan's parameter memory (unless ``options`` say otherwise)."""
    case = CASES[case_name]
    reference, hand, x = case.build(mesh)
    hand_bytes = sum(p.to_local().numel() * p.element_size() for p in hand.parameters())
    options.setdefault("param_memory_budget_bytes", hand_bytes)
    layout = BOUNDARY[case_name]
    solution = dtcompile.auto_parallel.plan(
        reference, mesh, (x,), input_placements=[layout], output_placements=[layout], **options
    )
    return reference, hand, x, solution, hand_bytes


def build_block_stack(mesh: Any, layers: int = 3) -> tuple[Any, None, Any]:
    r"""``(reference, None, input)``: ``layers`` shared :class:`~dtcompile._testing.models.Block`\ s
    in an ``nn.Sequential`` (repeated layers, for tying), seeded as the shared models are."""
    from torch import nn

    with models._plain_tensors(0) as gen:
        reference = models._init_weights(nn.Sequential(*[models.Block(models.BlockArgs()) for _ in range(layers)]), gen)
        x = torch.randn(2, 8, models.BlockArgs().dim, generator=gen)
    return reference, None, x


def rank_apply(rank: int, case_name: str, world_size: int, solution: Any) -> tuple[Any, ...]:
    """On one rank thread: apply ``solution`` (planned once, on a fake world) to this rank's
    mesh, compile with dtcompile, one step; and the single-process step (see :func:`rank_step`).
    ``case_name``: a case of ``dtcompile._testing.cases``, or ``block_stack`` (1-D ``tp``)."""
    from torch.distributed.device_mesh import init_device_mesh

    if case_name == "block_stack":
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
        reference, _, x = build_block_stack(mesh)
    else:
        case = CASES[case_name]
        mesh = case.mesh(world_size)
        reference, _, x = case.build(mesh)
    return _step_against_reference(rank, dtcompile.auto_parallel.parallelize(reference, solution, mesh), reference, x, mesh, solution)
