"""Demo: the tensor + sequence parallel block compiled with dtcompile on 4 simulated ranks.

Run ``python -m dtcompile.demo``.  The block's attention core is a ``local_map``
region on head-sharded q, k and v (``--model tp_sp_block`` for the plain block).
Each rank is a thread of this process with a
real-semantics process group; every rank compiles the block with
``backend="dtcompile"``, runs forward and backward, and is checked against eager
and against the single-process block.  Then rank 0's inspection report
(``dtcompile.explain``: DTensor placements node by node, the collectives each
causes with estimated times, the ``local_map`` regions, totals, graph breaks,
recompiles) is printed.
"""

from __future__ import annotations

import argparse
import sys

import torch

from dtcompile._testing.cases import (
    CASES,
    StepResult,
    rank_eager_and_compiled,
    reference_step,
)
from dtcompile.testing import fake_world, run_threaded


def _max_diff(a: StepResult, b: StepResult) -> float:
    diffs = [(a.output - b.output).abs().max()]
    diffs += [(a.grads[n] - b.grads[n]).abs().max() for n in a.grads]
    return float(torch.stack(diffs).max())


def _report(case_name: str, world_size: int, inductor: bool) -> str:
    """Rank 0's inspection report (placements, communication, costs), traced on the fake PG."""
    import dtcompile

    case = CASES[case_name]
    with fake_world(world_size, case.mesh_shape(world_size), case.mesh_dim_names) as mesh:
        _, parallel, x = case.build(mesh)
        report = dtcompile.explain(parallel, inductor=inductor)(case.local_input(x, mesh))
    return report.text(aot_graphs=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tp_sp_block_local_map", choices=sorted(CASES))
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--no-inductor", action="store_true", help="skip Inductor lowering")
    args = parser.parse_args(argv)
    options = {"inductor": not args.no_inductor}

    print(f"dtcompile demo: {args.model} on {args.world_size} simulated ranks, {options}")
    results = run_threaded(
        args.world_size, rank_eager_and_compiled, args.model, args.world_size, options
    )
    reference = reference_step(args.model, args.world_size)
    ok = True
    tol = 1e-5
    for rank, (eager, compiled, num_graphs) in enumerate(results):
        vs_eager = _max_diff(compiled, eager)
        ok &= vs_eager <= tol and num_graphs >= 2
        print(
            f"rank {rank}: {num_graphs} graphs compiled; max |compiled - eager| "
            f"(output and gradients) = {vs_eager:.2e}"
        )
    # The reference's output and gradients are whole; rank 0 of a TP model sees all of it.
    eager0 = results[0][0]
    if CASES[args.model].data_parallel_axis is None:
        vs_reference = _max_diff(eager0, reference)
        ok &= vs_reference <= tol
        print(f"rank 0: max |eager - single-process reference| = {vs_reference:.2e}")
    print()
    print("rank 0's inspection report (dtcompile.explain; the annotated AOT graphs left out):")
    print(_report(args.model, args.world_size, options["inductor"]))
    print()
    print("OK: compiled matches eager and the reference" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
