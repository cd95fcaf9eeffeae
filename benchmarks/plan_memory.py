"""Auto-parallel under a step memory budget: the plan's estimated peak against the compiled step's measured one.

A stack of residual MLP blocks (``--blocks`` of dim 32 -> ``--hidden`` -> 32) whose saved
activations dwarf its parameters at batch ``--batch``, planned by ``dtcompile.auto_parallel.plan``
on the fake process group (1-D mesh of 4, ``dp``), with Adam, three ways:

- **free**: no budget (every rank holds everything: no collective is cheapest);
- **parameter budget**: ``param_memory_budget_bytes`` at half the free plan's estimated
  step peak, which parameter bytes alone never reach: the same plan;
- **step budget**: ``memory_budget_bytes`` at that half, through the compile config
  (one budget for the plan and the compile).

Each plan is applied and compiled with dtcompile (Inductor on), one training step with
Adam run on this rank's shard of the batch, after a first step that compiles and makes
the optimizer's state; the measured peak is the allocator's (``dtcompile.testing.measure_memory``).
``step us``: the plan's estimated step (h100 profile).

    python benchmarks/plan_memory.py [--batch 512] [--blocks 3] [--hidden 128]
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch import nn  # noqa: E402


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(x)))


class Stack(nn.Module):
    def __init__(self, blocks: int, hidden: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(32, hidden) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def measured_peak(model: nn.Module, x: torch.Tensor, solution, backend) -> int:
    import dtcompile
    from torch.distributed.tensor import DTensor, distribute_tensor

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=128)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")

    import dtcompile
    from dtcompile.base.notation import format_bytes
    from dtcompile.testing import fake_world

    torch.manual_seed(0)
    model = Stack(args.blocks, args.hidden)
    x = torch.randn(args.batch, 32)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"{args.blocks} blocks, hidden {args.hidden}, batch {args.batch}: {format_bytes(params)} of parameters; "
          "fake world of 4 (dp), h100, Adam, Inductor")
    print("| plan | budget | input | estimated peak | measured peak | measured / estimated | under budget | step us | plan s |")
    print("| --- | ---: | --- | ---: | ---: | ---: | --- | ---: | ---: |")
    with fake_world(4, (4,), ("dp",)) as mesh:
        start = time.perf_counter()
        free = dtcompile.auto_parallel.plan(model, mesh, (x,), optimizer="adam")
        rows = [("free", free, None, dtcompile.backend(), time.perf_counter() - start)]
        budget = free.peak_memory().total // 2
        start = time.perf_counter()
        blind = dtcompile.auto_parallel.plan(model, mesh, (x,), optimizer="adam", param_memory_budget_bytes=budget)
        rows.append(("parameter budget", blind, budget, dtcompile.backend(), time.perf_counter() - start))
        backend = dtcompile.backend(memory_budget_bytes=budget)
        start = time.perf_counter()
        kept = dtcompile.auto_parallel.plan(model, mesh, (x,), optimizer="adam", config=backend)
        rows.append(("step budget", kept, budget, backend, time.perf_counter() - start))
        for label, solution, limit, compile_backend, seconds in rows:
            estimate = solution.peak_memory().total
            measured = measured_peak(model, x, solution, compile_backend)
            torch._dynamo.reset()
            placement = "".join(map(str, solution.input_placements[0]))
            print(f"| {label} | {format_bytes(limit) if limit else '-'} | {placement} | {format_bytes(estimate)} | "
                  f"{format_bytes(measured)} | {measured / estimate:.3f} | "
                  f"{'-' if limit is None else ('yes' if measured <= limit else 'no')} | {solution.cost_us:.2f} | {seconds:.1f} |")


if __name__ == "__main__":
    main()
