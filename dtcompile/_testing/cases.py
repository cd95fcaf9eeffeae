"""The shared models as test cases: mesh, per-rank input, one training step.

A :class:`ModelCase` knows how to build its mesh for a world size, which slice
of the global input a rank feeds, and how to run one step (forward, loss
``out.pow(2).mean()``, backward) on the parallel model or on the single-process
reference, returning comparable plain tensors.  Data-parallel models average
gradients over ``dp``, so their gradients equal the reference's on the whole batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from dtcompile._testing import models
from dtcompile.base.channels import GraphKind

__all__ = [
    "CASES",
    "ModelCase",
    "StepResult",
    "assert_steps_close",
    "cache_counts",
    "rank_eager_and_compiled",
    "reference_step",
    "run_step",
]


@dataclass(frozen=True)
class StepResult:
    """One step's output and every parameter's full gradient, by reference name."""

    output: torch.Tensor
    grads: dict[str, torch.Tensor]


def assert_steps_close(got: StepResult, want: StepResult, what: str, *, rtol: float, atol: float) -> None:
    """``got``'s output and gradients close to ``want``'s; a failure names ``what`` and the tensor."""
    torch.testing.assert_close(got.output, want.output, rtol=rtol, atol=atol, msg=lambda m: f"{what}: output: {m}")
    assert got.grads.keys() == want.grads.keys(), what
    for name, grad in got.grads.items():
        torch.testing.assert_close(
            grad, want.grads[name], rtol=rtol, atol=atol, msg=lambda m, n=name: f"{what}: grad of {n}: {m}"
        )


def cache_counts(backend: Any) -> dict[str, int]:
    """What torch's compile caches did in this process (Dynamo's counters: Inductor's
    ``fxgraph_cache_*``, AOTAutograd's ``autograd_cache_*``) and what ``backend`` (a
    dtcompile backend) compiled, took from AOTAutograd's cache, or ran eagerly."""
    from torch._dynamo.utils import counters

    return {
        **{k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")},
        **{k: v for k, v in counters["aot_autograd"].items() if k.startswith("autograd_cache")},
        "compiled": len(backend.records),
        "cached": len(backend.cached),
        "fallbacks": len(backend.fallbacks),
    }


@dataclass(frozen=True)
class ModelCase:
    name: str
    build: Callable[..., tuple[nn.Module, nn.Module, torch.Tensor]]
    """``build(mesh) -> (reference, parallel, global_input)``, see :mod:`models`."""
    mesh_dim_names: tuple[str, ...]
    data_parallel_axis: str | None
    """The mesh axis over which ranks feed different slices of the batch."""

    def mesh_shape(self, world_size: int) -> tuple[int, ...]:
        """1-D: all ranks on one axis; 2-D: ``dp=2`` and the rest on the second axis."""
        return (world_size,) if len(self.mesh_dim_names) == 1 else (2, world_size // 2)

    def mesh(self, world_size: int, device_type: str = "cpu") -> DeviceMesh:
        return init_device_mesh(
            device_type, self.mesh_shape(world_size), mesh_dim_names=self.mesh_dim_names
        )

    def local_input(self, x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        """The slice of the global input this rank feeds (all of it without data parallelism)."""
        if self.data_parallel_axis is None:
            return x
        axis = self.mesh_dim_names.index(self.data_parallel_axis)
        coordinate = mesh.get_coordinate()
        assert coordinate is not None, "this rank is not part of the mesh"
        return x.chunk(mesh.size(axis))[coordinate[axis]]

    def local_output(self, out: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        """The slice of the reference output this rank's output must equal."""
        return self.local_input(out, mesh)


CASES: dict[str, ModelCase] = {
    case.name: case
    for case in [
        ModelCase("tp_mlp", models.build_mlp, ("tp",), None),
        ModelCase("tp_sp_block", models.build_block, ("tp",), None),
        ModelCase("tp_sp_block_local_map", models.build_block_local_map, ("tp",), None),
        ModelCase("fsdp_mlp", models.build_fsdp_mlp, ("dp",), "dp"),
        ModelCase("block_2d", models.build_block_2d, ("dp", "tp"), "dp"),
        ModelCase("gathered_stack", models.build_gathered_stack, ("dp",), None),
    ]
}


def _reference_name(name: str) -> str:
    # parametrize stores the DTensor parameter as `<module>.parametrizations.<name>.original`.
    return name.replace(".parametrizations.", ".").removesuffix(".original")


def run_step(model: nn.Module | Callable[..., Any], params: nn.Module, x: torch.Tensor) -> StepResult:
    """Forward, ``out.pow(2).mean()`` backward; gradients gathered to full tensors."""
    for p in params.parameters():
        p.grad = None
    out = model(x)
    out.pow(2).mean().backward()
    grads = {}
    for name, p in params.named_parameters():
        assert p.grad is not None, f"parameter {name} got no gradient"
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        grads[_reference_name(name)] = grad.detach()
    if isinstance(out, DTensor):
        out = out.full_tensor()
    return StepResult(out.detach().clone(), grads)


def rank_eager_and_compiled(
    rank: int, case_name: str, world_size: int, backend_options: dict[str, Any] | None
) -> tuple[StepResult, StepResult, int]:
    """On one rank: an eager step, then a step compiled with dtcompile, on the same model.

    Returns both results and how many graphs dtcompile compiled on this rank (a
    compiled run that compiled nothing would silently be eager).
    """
    import dtcompile
    from dtcompile.testing.worlds import wait_for_eager_on_every_rank

    case = CASES[case_name]
    mesh = case.mesh(world_size)
    _, parallel, x = case.build(mesh)
    local_x = case.local_input(x, mesh)
    eager = run_step(parallel, parallel, local_x)
    wait_for_eager_on_every_rank()
    backend = dtcompile.backend(**(backend_options or {}))
    compiled = torch.compile(parallel, backend=backend, fullgraph=True)
    return eager, run_step(compiled, parallel, local_x), len(backend.records)


def reference_step(case_name: str, world_size: int) -> StepResult:
    """The single-process reference step for a case (whole batch, whole output).

    Needs no process group: the reference model is built on a fake world.
    """
    from dtcompile.testing.worlds import fake_world

    case = CASES[case_name]
    with fake_world(world_size):
        reference, _, x = case.build(case.mesh(world_size))
    return run_step(reference, reference, x)


def pass_context(config: Any = None, kind: GraphKind = GraphKind.FORWARD, profile: Any = None) -> Any:
    """A :class:`~dtcompile.passes.PassContext` for a hand-built graph: ``config`` (default
    options), priced with ``profile`` (a name or profile; default what ``config.cost_profile``
    picks for a CPU graph in the fake world: ``h100`` under ``auto``)."""
    from dtcompile.annotations import DynamoGraphInfo
    from dtcompile.config import DTCompileConfig
    from dtcompile.cost import choose_profile
    from dtcompile.passes import PassContext

    config = config if config is not None else DTCompileConfig()
    chosen = choose_profile(profile if profile is not None else config.cost_profile, {"cpu"}, {"fake"})
    return PassContext(kind=kind, config=config, info=DynamoGraphInfo("test", {}, chosen.profile, chosen.why))
