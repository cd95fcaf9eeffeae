"""A model whose activations dwarf its parameters, and one compiled training step's measured peak: the
auto-parallel step-memory test (``tests/auto_parallel/test_peak.py``) and benchmark
(``benchmarks/plan_memory.py``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(x)))


class Stack(nn.Module):
    """Residual MLP blocks of dim 32: three of hidden 128 hold 25k parameters, and at batch 512
    the activations the forward saves (1.6 MiB replicated) are 16 times them."""

    def __init__(self, blocks: int = 3, hidden: int = 128) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(32, hidden) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def measured_peak(model: nn.Module, x: torch.Tensor, solution: Any, backend: Any) -> int:
    """One compiled training step with Adam (after a first one that compiles and makes the
    optimizer's state), on this rank of the fake world: its peak as the allocator saw it."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    import dtcompile
    from dtcompile.testing import measure_memory

    parallel = dtcompile.auto_parallel.parallelize(model, solution)
    compiled = torch.compile(parallel, backend=backend)
    local = distribute_tensor(x, solution.problem.mesh, solution.input_placements[0])
    optimizer = torch.optim.Adam(parallel.parameters(), lr=1e-3)

    def step() -> None:
        out = compiled(local)
        (out.to_local() if isinstance(out, DTensor) else out).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    states = [t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    return measure_memory(step, [*parallel.parameters(), local, *states]).peak_bytes
