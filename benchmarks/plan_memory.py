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

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # tests/support: the model and the measured step

import torch  # noqa: E402
from support.peak_models import Stack, measured_peak  # noqa: E402


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
