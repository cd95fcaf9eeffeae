"""``local_map`` regions for the tests: each case is a region, its inputs, and a single-process reference.

A case builds, on a given mesh, the DTensor inputs (from global tensors drawn
with a fixed seed), the function to compile (the region plus a little code
around it, so the region's outputs flow into DTensor ops), and the same
computation on the global tensors in one process.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_tensor,
)

from dtcompile.hops import local_map

__all__ = [
    "BACKENDS",
    "REGION_CASES",
    "RegionCase",
    "gloo_rank",
    "reference_step",
    "run_case",
]


@dataclass(frozen=True)
class RegionCase:
    name: str
    mesh_shape: tuple[int, ...]
    mesh_names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    placements: tuple[tuple[Any, ...], ...]
    """The inputs' placements (one tuple per input)."""
    make: Callable[[Any], Callable[..., Any]]
    """mesh -> the function to compile (takes the DTensor inputs)."""
    reference: Callable[..., torch.Tensor]
    """The same computation on the global tensors (returns a tensor to compare)."""

    def global_inputs(self, seed: int = 0) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        return [torch.randn(shape, generator=gen) for shape in self.shapes]

    def inputs(self, mesh: Any, tensors: list[torch.Tensor]) -> list[DTensor]:
        """Leaf DTensors that require grad, placed per ``placements`` (draw ``tensors``
        with :meth:`global_inputs` outside ``LocalTensorMode``: inside it, a draw differs by rank)."""
        return [
            distribute_tensor(t.detach(), mesh, p).requires_grad_()
            for t, p in zip(tensors, self.placements)
        ]


def _sharded_pointwise(mesh: Any) -> Callable[..., Any]:
    @local_map(out_placements=[Shard(0)], in_placements=([Shard(0)],), device_mesh=mesh)
    def gelu_scale(x):
        return torch.nn.functional.gelu(x) * 3.0

    def fn(x):
        return gelu_scale(x) + 1.0

    return fn


def _replicated_linear(mesh: Any) -> Callable[..., Any]:
    @local_map(
        out_placements=[Replicate()],
        in_placements=([Replicate()], [Replicate()], [Replicate()]),
        device_mesh=mesh,
    )
    def linear(x, w, b):
        return torch.nn.functional.linear(x, w, b)

    def fn(x, w, b):
        return linear(x, w, b).tanh()

    return fn


def _cp_attention(mesh: Any) -> Callable[..., Any]:
    # Batch sharded on dp; the query sharded on the sequence over cp, key and value
    # whole on each cp rank: each cp rank's key/value gradient is its share of a sum.
    q_p, kv_p, kv_grad = (
        (Shard(0), Shard(1)),
        (Shard(0), Replicate()),
        (Shard(0), Partial()),
    )

    @local_map(
        out_placements=(q_p,),
        in_placements=(q_p, kv_p, kv_p),
        in_grad_placements=(q_p, kv_grad, kv_grad),
        device_mesh=mesh,
    )
    def attention(q, k, v):
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        return torch.softmax(scores, dim=-1) @ v

    def fn(q, k, v):
        return attention(q, k, v) * 0.5

    return fn


def _gather_then_column_parallel(mesh: Any) -> Callable[..., Any]:
    # Sequence parallel into a column-parallel matmul: the region all-gathers the
    # sequence-sharded activation itself (whose backward reduce-scatters).
    @local_map(
        out_placements=[Shard(1)],
        in_placements=([Shard(0)], [Shard(1)]),
        device_mesh=mesh,
    )
    def gather_matmul(x, w):
        full = funcol.all_gather_single(x, 0, (mesh, 0))
        return full @ w

    def fn(x, w):
        return gather_matmul(x, w).relu()

    return fn


def _attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> torch.Tensor:
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    return (torch.softmax(scores, dim=-1) @ v) * 0.5


REGION_CASES: dict[str, RegionCase] = {
    c.name: c
    for c in (
        RegionCase(
            "sharded_pointwise",
            (4,),
            ("tp",),
            ((8, 6),),
            ((Shard(0),),),
            _sharded_pointwise,
            lambda x: torch.nn.functional.gelu(x) * 3.0 + 1.0,
        ),
        RegionCase(
            "replicated_linear",
            (4,),
            ("tp",),
            ((4, 6), (5, 6), (5,)),
            ((Replicate(),),) * 3,
            _replicated_linear,
            lambda x, w, b: torch.nn.functional.linear(x, w, b).tanh(),
        ),
        RegionCase(
            "cp_attention",
            (2, 2),
            ("dp", "cp"),
            ((4, 8, 6),) * 3,
            ((Shard(0), Shard(1)), (Shard(0), Replicate()), (Shard(0), Replicate())),
            _cp_attention,
            _attention_reference,
        ),
        RegionCase(
            "region_with_collective",
            (4,),
            ("tp",),
            ((8, 6), (6, 8)),
            ((Shard(0),), (Shard(1),)),
            _gather_then_column_parallel,
            lambda x, w: (x @ w).relu(),
        ),
    )
}


# What each numerics test compiles with: name -> torch.compile backend (None: eager).
BACKENDS: dict[str, Callable[[], Any] | None] = {
    "eager": None,
    "dtcompile": lambda: __import__("dtcompile").backend(inductor=False),
    "dtcompile_inductor": lambda: __import__("dtcompile").backend(),
    "aot_eager": lambda: "aot_eager",
    "inductor": lambda: "inductor",
}


def run_case(
    case: RegionCase, mesh: Any, tensors: list[torch.Tensor], backend: str
) -> list[torch.Tensor]:
    """One step of ``case`` under ``backend``: the output and each input's gradient, as full tensors."""
    fn = case.make(mesh)
    make = BACKENDS[backend]
    if make is not None:
        fn = torch.compile(fn, backend=make(), fullgraph=True)
    inputs = case.inputs(mesh, tensors)
    out = fn(*inputs)
    full = out.full_tensor()
    full.sum().backward()
    return [full.detach(), *(x.grad.full_tensor() for x in inputs)]


def reference_step(case: RegionCase, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The same step in one process on the global tensors."""
    inputs = [t.detach().clone().requires_grad_() for t in tensors]
    out = case.reference(*inputs)
    out.sum().backward()
    return [out.detach(), *(x.grad for x in inputs)]


def gloo_rank(
    rank: int, world_size: int, backends: list[str]
) -> dict[tuple[str, str], list[torch.Tensor]]:
    """Every case under every backend on a real gloo rank (the 2-D case on a ``(1, world_size)`` mesh)."""
    from torch.distributed.device_mesh import init_device_mesh

    results = {}
    for name, case in REGION_CASES.items():
        shape = (world_size,) if len(case.mesh_shape) == 1 else (1, world_size)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=case.mesh_names)
        for backend in backends:
            torch._dynamo.reset()
            results[name, backend] = run_case(case, mesh, case.global_inputs(), backend)
    return results
